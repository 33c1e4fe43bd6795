"""Phase 2 of a harness run: an external agent harness drives the episodes through phaserl's
OpenAI-compatible endpoint, and the recorded completions become a `RolloutBatch`.

Chosen once when the run is built (`with_agent` in agent_phase.py, when `agent.harness` is set). Per
call, inside the actor's rollout mode: a `GenerateBackend` on the actor (batching the harness's
concurrent requests) and a `ChatServer` on 127.0.0.1 (context = the episode token budget, default
max_tokens = rollout.max_new_tokens) start; `run_harness_samples` runs the harness n times per prompt
row of this rank; server and backend stop (always, also when the harness or the decode fails).

Limits: the server refuses a conversation's request past agent.max_turns completions or past the
episode token budget (HTTP 400, which the openai client raises), caps each completion at
rollout.max_new_tokens, and the episode ends with that limit as its finish reason (agent/ended/*).

Sampling: the run's settings win. The server samples every request with this phase's temperature /
top_p / top_k (rollout.* for training, rollout.val_* for validation) from the run's seeded
`sampling_generator`; a request asking for another temperature or top_p is answered with the run's
and a one-time warning, because training computes the old log-probs at rollout.temperature. A
request's `seed` still fixes its own sample; `max_tokens` may differ per request (capped by the room
left in the episode budget). Which requests meet in one batched generate call depends on thread
timing, so a seeded harness run is not repeated bit for bit (agent.env runs with agent.overlap=false are).

Groups stay exact: each prompt contributes exactly n rows, in order. Per (row, sample):
- one recorded piece: that episode;
- several pieces (a prompt that did not continue the previous completion token for token; see
  recorder.py): the last piece is kept (it holds the final reply the reward judges), the earlier ones
  are dropped and counted in `agent/harness_dropped_pieces_mean`;
- no request at all (the harness raised or timed out first): an empty episode (the prompt's ids, no
  response, loss mask 0, reward 0, finish reason env_error), counted in `agent/harness_missing_mean`.
Rewards: the harness's return value, or for None the run's reward.functions on the last reply
(`EpisodeScores` places it on the last sampled token). Not here: HTTP (agents/server.py), recording
(agents/recorder.py), running the harness threads (agents/harness.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from ..agents.completion import GenerateBackend
from ..agents.env import Episode, Segment
from ..agents.harness import harness_row, run_harness_samples
from ..agents.server import ChatServer
from ..batch import RolloutBatch
from .episode_batch import episodes_batch
from .rollout_phase import group_offset

log = logging.getLogger("phaserl")


@dataclass(frozen=True)
class HarnessSettings:
    harness: Callable                 # harness(base_url, row) -> reward | None
    reward: Callable                  # (prompt, response, ground_truth, **row) -> float: for a harness returning None
    workers: int                      # conversations at once, per rank
    timeout_s: float                  # one conversation, at most
    tool_parser: str                  # agents.tool_parsers name
    max_episode_tokens: int           # the server's context: prompt + every turn, at most
    max_turns: int                    # completions per conversation (agent.max_turns); then HTTP 400
    context_reason: str               # what max_episode_tokens stands for: "max_tokens" | "context" (the model's)


def harness_rollout(trainer, items: list, params, n: int) -> RolloutBatch:
    """Phase 2, harness: n harness conversations per prompt through a localhost endpoint (module docstring)."""
    run, actor = trainer.run, trainer.actor
    h = run.agent
    first = trainer.rank * len(items) * n
    run.sampling_generator.manual_seed(hash((run.seed, trainer.step_num, first, n, 2)) & (2**63 - 1))
    eos = [] if run.ignore_eos else run.eos_token_ids
    backend = GenerateBackend(actor, eos_token_ids=eos, pad_token_id=run.pad_token_id,
                              max_batch=run.generate_batch_size * n, generator=run.sampling_generator)
    try:
        server = ChatServer(backend, run.tokenizer, parser=h.tool_parser, default_max_tokens=params.max_new_tokens,
                            max_context=h.max_episode_tokens, sampling=(params.temperature, params.top_p, params.top_k),
                            max_turns=h.max_turns, max_turn_tokens=params.max_new_tokens,
                            context_reason=h.context_reason)
        try:
            server.start()
            per_sample = run_harness_samples(h.harness, [harness_row(item.row) for item in items], server,
                                             samples_per_row=n, max_workers=h.workers, timeout_s=h.timeout_s,
                                             reward=h.reward, episode_rows=[item.row for item in items])
        finally:
            server.close()
    finally:
        backend.close()
    episodes = exact_groups(per_sample, [item for item in items for _ in range(n)])
    batch = episodes_batch(episodes, n, tokenizer=run.tokenizer, pad_token_id=run.pad_token_id,
                           group_offset=group_offset(trainer), device=actor.device)
    batch.rollout_metrics["agent/harness_generate_calls"] = float(backend.calls)
    return batch


def exact_groups(per_sample: list, items: list) -> list:
    """One Episode per (row, sample), in order: the last piece, or an empty env_error episode (module docstring).

    per_sample: [[Episode]] per (row, sample); items: the PromptItem of each (row, sample)."""
    assert len(per_sample) == len(items), (len(per_sample), len(items))
    out = []
    for pieces, item in zip(per_sample, items):
        if pieces:
            episode = pieces[-1]
        else:
            episode = Episode(row=item.row, segments=[Segment("prompt", list(item.prompt_ids))], turn_rewards=[0.0],
                              finish_reason="env_error", num_turns=0)
        episode.metrics.update({"harness_missing": float(not pieces),
                                "harness_dropped_pieces": float(max(0, len(pieces) - 1))})
        out.append(episode)
    missing = sum(not p for p in per_sample)
    if missing:
        log.warning("harness: %d of %d conversations made no request; each is an empty episode (reward 0, "
                    "nothing trained; agent/harness_missing_mean)", missing, len(per_sample))
    return out
