"""An external agent harness that `phaserl train` drives as its episode source (agent.harness).

    pip install "phaserl[agents]"
    phaserl train examples/agent_harness.yaml

phaserl calls `harness(base_url, row)` n times per prompt row during rollout; `base_url` is its
OpenAI-compatible endpoint on localhost, served by the policy being trained. This harness asks the
tiny world's addition, and when the answer is wrong says so and asks once more; it returns the
episode's reward (1 when the last answer is right). Every completion's token ids and log-probs are
recorded by phaserl and trained on exactly; the "no ..." turn between them is masked out of the loss.
Any code written against the `openai` client works the same way (returning None lets the run's
reward.functions score the last reply instead).
"""
from __future__ import annotations

import openai

from phaserl.rewards.rules import tiny_exact


def harness(base_url: str, row: dict) -> float:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = list(row["prompt"])                     # [{"role": "user", "content": "57+68="}]
    question = messages[-1]["content"]
    reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
    if tiny_exact(question, reply, row["ground_truth"]):
        return 1.0
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"no {question}"}]
    reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
    return tiny_exact(question, reply, row["ground_truth"])
