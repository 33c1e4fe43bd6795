"""Run a user's external agent harness over data rows and collect token-exact Episodes.

A harness is a plain function that drives one conversation through an OpenAI client:

    def harness(base_url: str, row: dict) -> float | None:
        client = openai.OpenAI(base_url=base_url, api_key="unused")
        ... client.chat.completions.create(model="phaserl-policy", messages=..., tools=...) ...
        return reward      # or None: then `reward` (a rule reward on the last reply) scores it

`run_harness` gives every (row, sample) its own conversation URL on the running `ChatServer`, runs
up to `max_workers` harness calls at once in daemon threads (their requests meet in the server's
batching backend), and turns each recorded conversation into Episodes (recorder.py), in row order.
A harness that raises gives its recorded turns as an episode with finish_reason "env_error" and
reward 0 (logged with the row), unless it raised at the server's refusal of an episode limit
(agent.max_turns, the token budget: server.py): then the episode ends with that limit as its reason,
scored by `reward` on the last reply (0 without one; a harness that catches the error and returns
its reward keeps that reward); one that outlives `timeout_s` is abandoned the same way, and its
conversation is closed so its late requests are refused. A harness that made no request yields
nothing. `run_harness_samples` gives the same episodes as one list per (row, sample), for a caller
that must keep groups exact (the trainer's harness_phase). Not here: where these episodes go.
"""
from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections import deque
from typing import Callable, Optional

from phaserl.agents.tool_env import final_reward_fn

log = logging.getLogger("phaserl.agents.harness")


def run_harness(harness: Callable, rows: list, server, *, samples_per_row: int = 1, max_workers: int = 16,
                timeout_s: Optional[float] = None, reward=None, reward_kwargs: Optional[dict] = None,
                episode_rows: Optional[list] = None) -> list:
    """Episodes of `harness(base_url, row)` over rows x samples_per_row (see the module docstring).

    episode_rows: what each Episode.row holds (e.g. the trainer's PromptRows while the harness gets
    plain dicts); default `rows`. The samples of a row come out consecutively, as a GRPO group."""
    per_sample = run_harness_samples(harness, rows, server, samples_per_row=samples_per_row, max_workers=max_workers,
                                     timeout_s=timeout_s, reward=reward, reward_kwargs=reward_kwargs,
                                     episode_rows=episode_rows)
    return [episode for episodes in per_sample for episode in episodes]


def run_harness_samples(harness: Callable, rows: list, server, *, samples_per_row: int = 1, max_workers: int = 16,
                        timeout_s: Optional[float] = None, reward=None, reward_kwargs: Optional[dict] = None,
                        episode_rows: Optional[list] = None) -> list:
    """run_harness's episodes as [[Episode] per (row, sample)], row-major: [] for a conversation that made
    no request, several for one whose record split into pieces (recorder.py)."""
    if samples_per_row < 1 or max_workers < 1:
        raise ValueError(f"run_harness: samples_per_row={samples_per_row} and max_workers={max_workers} must be >= 1")
    episode_rows = rows if episode_rows is None else episode_rows
    if len(episode_rows) != len(rows):
        raise ValueError(f"run_harness: {len(episode_rows)} episode_rows for {len(rows)} rows")
    score = final_reward_fn(reward, dict(reward_kwargs or {}), where="run_harness") if reward is not None else None
    run_id = uuid.uuid4().hex[:8]
    jobs = [(i, k, f"{run_id}-{i}-{k}") for i in range(len(rows)) for k in range(samples_per_row)]
    outcomes: dict = {}

    def work(job):
        i, _, conv_id = job
        try:
            outcomes[job] = ("ok", harness(server.conversation_url(conv_id), rows[i]))
        except Exception as exc:  # the harness's own bug or a refused request: the row's episode ends here
            outcomes[job] = ("error", exc)

    pending, running = deque(jobs), {}
    while pending or running:
        while pending and len(running) < max_workers:
            job = pending.popleft()
            thread = threading.Thread(target=work, args=(job,), name=f"phaserl-harness-{job[2]}", daemon=True)
            thread.start()
            running[job] = (thread, time.perf_counter())
        time.sleep(0.002)
        for job, (thread, start) in list(running.items()):
            if not thread.is_alive():
                del running[job]
            elif timeout_s is not None and time.perf_counter() - start > timeout_s:
                outcomes.setdefault(job, ("timeout", None))
                del running[job]

    per_sample, first_error = [], None
    for job in jobs:
        i, k, conv_id = job
        conv = server.store.pop(conv_id)
        status, value = outcomes.get(job, ("timeout", None))
        if status == "error" and conv is not None and conv.ended:
            status = "limit"  # it raised at the refusal of an episode limit (server.py): the episode ended there
        if status not in ("ok", "limit"):
            first_error = first_error or (status, value, i)
            log.warning("harness on row %d (sample %d) %s; its recorded turns are kept with reward 0", i, k,
                        f"raised {type(value).__name__}: {value}" if status == "error" else f"ran past {timeout_s} s")
        per_sample.append([])
        if conv is None or not conv.turns:
            continue
        reward = _reward(status, value, score, rows[i], conv, i)
        for episode in conv.episodes(episode_rows[i], reward):
            if status not in ("ok", "limit"):
                episode.finish_reason = "env_error"
            episode.metrics.update({"harness_errors": float(status == "error"),
                                    "harness_timeouts": float(status == "timeout")})
            per_sample[-1].append(episode)
    if not any(per_sample) and first_error is not None:
        status, value, i = first_error
        raise RuntimeError(f"run_harness: no harness call recorded a completion; the first failure was on row {i}: "
                           + (f"{type(value).__name__}: {value}" if status == "error"
                              else f"timeout after {timeout_s} s")) \
            from (value if isinstance(value, Exception) else None)
    return per_sample


def _reward(status: str, value, score, row, conv, i: int) -> float:
    if status == "limit":  # no value came back: the rule reward judges the last reply, if there is one
        return 0.0 if score is None else score(row if isinstance(row, dict) else vars(row),
                                                (conv.reply or {}).get("content", ""))
    if status != "ok":
        return 0.0
    if value is None:
        if score is None:
            raise ValueError(f"run_harness: the harness returned None for row {i} and no `reward` was given; "
                             "return the episode's reward, or pass reward='<rule name>' to score the last reply")
        return score(row if isinstance(row, dict) else vars(row), (conv.reply or {}).get("content", ""))
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"run_harness: the harness returned {value!r} for row {i}; return a number (the reward) "
                         "or None") from None
    if not math.isfinite(number):
        raise ValueError(f"run_harness: the harness returned a non-finite reward {number} for row {i}")
    return number


def harness_row(row) -> dict:
    """What a harness gets for a PromptRow: the raw record with prompt, ground_truth, data_source and
    extra_info normalized (the names rule reward functions see)."""
    return {**row.raw, "prompt": row.prompt, "ground_truth": row.ground_truth, "data_source": row.data_source,
            "extra_info": row.extra_info}


def rules_reward(specs: list, *, timeout_s: float) -> Callable:
    """`reward=` for run_harness from reward.functions [(name, weight, kwargs)]: their weighted total."""
    from phaserl.rewards.registry import RuleRewards  # the same checks and errors as reward.functions

    rules = RuleRewards(list(specs), timeout_s=timeout_s)

    def reward(prompt, response, ground_truth, **row) -> float:
        return rules.score([prompt], [response], [ground_truth], [row])[0][0]

    return reward


def quiet_client_logs() -> None:
    """The openai client logs every request at INFO through httpx: thousands of lines a rollout. Raise
    httpx's level to WARNING unless the user set it."""
    if logging.getLogger("httpx").level == logging.NOTSET:
        logging.getLogger("httpx").setLevel(logging.WARNING)

