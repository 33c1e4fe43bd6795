"""An external agent harness, written against the `openai` client, driving phaserl's policy.

    pip install "phaserl[agents]"
    python examples/openai_harness.py

It serves the tiny world's model on localhost, runs a two-turn harness (ask, then ask to check)
over four rows with two samples each, and prints what phaserl recorded for training: per episode
its sampled ids (model segments, with log-probs) and the appended ids (observations, masked out).
In a training run the policy behind the endpoint is the actor in rollout mode (GenerateBackend(actor)).
"""
from __future__ import annotations

import openai
from transformers import AutoTokenizer

from phaserl.agents.completion import GenerateBackend
from phaserl.agents.harness import run_harness
from phaserl.agents.server import ChatServer
from phaserl.models.hf_io import load_pretrained
from phaserl.rollout.engine import RolloutEngine
from phaserl.world import prepare_tiny_world


def harness(base_url: str, row: dict) -> float:
    """One conversation; returns its reward (1 when the second answer is the right sum)."""
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    messages = [{"role": "user", "content": row["question"]}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": row["question"]}]
    second = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    return float(second.choices[0].message.content.strip() == str(row["answer"]))


def main() -> list:
    world = prepare_tiny_world()
    model = load_pretrained(world.model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(world.tokenizer_dir)
    backend = GenerateBackend(RolloutEngine(model), eos_token_ids=[tokenizer.eos_token_id],
                              pad_token_id=tokenizer.pad_token_id)
    rows = [{"question": f"{a}+{b}=", "answer": a + b} for a, b in [(12, 34), (25, 13), (40, 41), (7, 52)]]
    with ChatServer(backend, tokenizer) as server:
        episodes = run_harness(harness, rows, server, samples_per_row=2, max_workers=8)
    for ep in episodes:
        parts = [f"{s.kind}:{tokenizer.decode(s.token_ids)!r}" for s in ep.segments]
        print(f"reward {ep.reward:.0f}  turns {ep.num_turns}  " + "  ".join(parts))
    print(f"{len(episodes)} episodes, {sum(map(len, (ep.response_ids() for ep in episodes)))} response tokens, "
          f"{backend.calls} batched generate calls")
    return episodes


if __name__ == "__main__":
    main()
