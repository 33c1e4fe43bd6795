"""One learning run of the tiny arithmetic world with heavy-tailed response lengths (CPU), in this process.

The quickstart's arithmetic world (phaserl/world/quickstart.yaml) with rollout.ignore_eos on and a length drawn for
every training response: the answer's room (the world's rollout.max_new_tokens, 4 tokens: up to three digits and
EOS) and then a tail from long_tail.draw_length scaled to `longest - 4` (90% of tails short, 8% middling, 2% the
longest). The sync step's generate call gets the lengths as per-sample caps; the asynchronous stream's decode
session gets them when a sample starts (a sample continued after a cut keeps its length). The tail tokens are
sampled and trained like any others, as a long reasoning trace is; the reward reads only the answer, the text
before the first EOS (`tiny_exact` reads the whole decoded text, which with EOS ignored runs on past it).

Held-out validation is the world's own: greedy, EOS ends the answer, the world's 4-token cap, no drawn lengths
(the tail is switched off while trainer.validate runs). The run goes through RLTrainer.fit with
trainer.val_interval; a hook records the wall time of every step, and validation's own time is left out of the
training wall clock.

Not here: running several seeds and bounds, and comparing against the synchronous score (async_learning.py
--tail runs this script once per run in a fresh process and does that).

    python benchmarks/tail_learning.py --k 1 --seed 0 --longest 48 --steps 40 --val-interval 2
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from long_tail import CappedSession, cap_starts, draw_length  # noqa: E402  (the GPU benchmark's lengths and session cap)


class AnswerThenTail:
    """Per-sample response lengths (answer room + drawn tail) in both rollout paths of one trainer; `off()` while
    validating. Sync: RolloutEngine.generate's max_new_tokens list; async: the decode session's start cap."""

    def __init__(self, trainer, *, answer: int, longest: int, seed: int):
        self.answer, self.longest, self.rng = answer, longest, random.Random(f"tail:{seed}")
        self.by_key: dict = {}
        actor = self.actor = trainer.actor
        self.generate, self.session = actor.engine.generate, actor.decode_session
        self.lengths: list = []  # every length drawn (what the tail looked like)

    def draw(self) -> int:
        length = self.answer + draw_length(self.rng, self.longest - self.answer)
        self.lengths.append(length)
        return length

    def on(self) -> None:
        def capped_generate(prompts, params, **kwargs):
            return self.generate(prompts, params, max_new_tokens=[self.draw() for _ in prompts], **kwargs)

        self.actor.engine.generate = capped_generate
        def capped_session(*args, **kwargs):
            if kwargs.get("keep"):  # a session kept across phases (rollout.partial_kv=keep): the object itself
                return cap_starts(self.session(*args, **kwargs), self)
            return CappedSession(self.session(*args, **kwargs), self)

        self.actor.decode_session = capped_session

    def off(self) -> None:
        self.actor.engine.generate, self.actor.decode_session = self.generate, self.session


@contextlib.contextmanager
def answers_before_eos(eos_ids: list):
    """Rewards read each response's ids up to its first EOS: both modules that decode responses for scoring."""
    from phaserl.trainer import rollout_phase, stream

    decode = rollout_phase.decode_responses
    stops = set(eos_ids)

    def decode_answers(tokenizer, responses):
        return decode(tokenizer, [_before_first(list(ids), stops) for ids in responses])
    rollout_phase.decode_responses = stream.decode_responses = decode_answers
    try:
        yield
    finally:
        rollout_phase.decode_responses = stream.decode_responses = decode


def _before_first(ids: list, stops: set) -> list:
    return next((ids[:i] for i, t in enumerate(ids) if t in stops), ids)


class TrainClock:
    """Wall and CPU seconds since training started, validation's own seconds left out."""

    def __init__(self):
        self.wall = self.cpu = 0.0  # validation's seconds so far
        self.t0 = self.c0 = None

    def start(self, trainer=None) -> None:
        self.t0, self.c0 = time.perf_counter(), time.process_time()

    def now(self) -> tuple:
        if self.t0 is None:
            return 0.0, 0.0
        return (round(time.perf_counter() - self.t0 - self.wall, 3), round(time.process_time() - self.c0 - self.cpu, 3))


def plain_validation(trainer, tail: AnswerThenTail, answer: int, clock: TrainClock, series: list) -> None:
    """trainer.validate as the world runs it: EOS honoured, the world's cap, no drawn lengths. Each appends
    (step, training wall and CPU seconds so far, held-out score) to `series`; its own seconds are not counted."""
    validate = trainer.validate

    def validate_plainly():
        wall, cpu = clock.now()
        run, stats, t0, c0 = trainer.run, trainer.actor.engine.last_stats, time.perf_counter(), time.process_time()
        trainer.run = dataclasses.replace(run, ignore_eos=False, val_sampling=dataclasses.replace(
            run.val_sampling, max_new_tokens=answer))
        tail.off()
        try:
            metrics = validate()
        finally:
            tail.on()
            trainer.run, trainer.actor.engine.last_stats = run, stats  # the step's rollout stats, not validation's
            clock.wall += time.perf_counter() - t0
            clock.cpu += time.process_time() - c0
        series.append(dict(step=trainer.step_num, wall_s=wall, cpu_s=cpu, val=round(metrics["val/score_mean"], 4)))
        return metrics
    trainer.validate = validate_plainly


def build(seed: int, k: int, longest: int, steps: int, val_interval: int, overrides: list, out: str):
    from phaserl.cli import QUICKSTART_CONFIGS
    from phaserl.config import load_config
    from phaserl.trainer import RLTrainer
    from phaserl.world import prepare_tiny_world

    prepare_tiny_world()
    cfg = load_config(QUICKSTART_CONFIGS["arith"], [
        f"trainer.seed={seed}", f"rollout.max_staleness={k}", "rollout.ignore_eos=true",
        f"rollout.max_new_tokens={longest}", f"trainer.total_steps={steps}", f"trainer.val_interval={val_interval}",
        f"trainer.log_dir={out}/logs", f"trainer.checkpoint_path={out}/ckpt", "trainer.loggers=[jsonl]",
        "trainer.save_interval=0", *overrides])
    answer = load_config(QUICKSTART_CONFIGS["arith"], []).rollout.max_new_tokens  # the world's own cap
    if longest <= answer:
        raise ValueError(f"--longest {longest}: a response needs the answer's {answer} tokens and a tail; "
                         f"pass more than {answer}")
    return RLTrainer.from_config(cfg), answer


def run(seed: int, k: int, longest: int, steps: int, val_interval: int, overrides: list) -> dict:
    with tempfile.TemporaryDirectory() as out:
        trainer, answer = build(seed, k, longest, steps, val_interval, overrides, out)
        with trainer.actor.rollout_mode():
            trainer.actor._ensure_engine()
        tail = AnswerThenTail(trainer, answer=answer, longest=longest, seed=seed)
        tail.on()
        clock, series, rows, seen = TrainClock(), [], [], {}
        plain_validation(trainer, tail, answer, clock, series)
        trainer.add_hook("on_train_start", clock.start)
        trainer.add_hook("on_step_end", lambda t: rows.append(_step_row(t, seen)))
        with answers_before_eos(trainer.run.eos_token_ids):
            trainer.fit()
    last = series[-1]  # validation at the last step, before the final checkpoint is written
    return dict(seed=seed, max_staleness=k, longest=longest, steps=steps, series=series, val_final=last["val"],
                train_wall_s=last["wall_s"], train_cpu_s=last["cpu_s"], val_wall_s=round(clock.wall, 2),
                per_step=_per_step(rows),
                tail_mean_length=round(statistics.mean(tail.lengths), 2))


def _step_row(trainer, seen: dict) -> dict:
    m = trainer.metrics
    stats = trainer.actor.engine.last_stats
    if stats is seen.get("stats"):  # no rollout this step (the async batch was ready): nothing decoded
        stats = {}
    seen["stats"] = trainer.actor.engine.last_stats
    return dict(rollout_s=m.get("timing_s/rollout", 0.0), update_s=m.get("timing_s/update", 0.0),
                step_s=m.get("timing_s/step", 0.0), length=m.get("train/response_length_mean", 0.0),
                decode_steps=stats.get("steps", 0), stepped_rows=stats.get("stepped_rows", 0),
                staleness=m.get("async/staleness_mean", 0.0))


def _per_step(rows: list) -> dict:
    """Means over the steps after the first (the async stream fills up in its first phase)."""
    later = rows[1:] or rows
    mean = {key: statistics.mean(r[key] for r in later) for key in
            ("step_s", "rollout_s", "update_s", "length", "staleness")}
    steps = sum(r["decode_steps"] for r in later)
    return {**{key: round(v, 3) for key, v in mean.items()}, "decode_steps": round(steps / len(later), 1),
            "rows_per_decode_step": round(sum(r["stepped_rows"] for r in later) / max(steps, 1), 1)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--k", type=int, default=0, help="rollout.max_staleness")
    p.add_argument("--longest", type=int, default=48, help="the longest response in tokens (answer room + tail)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--val-interval", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    a = p.parse_args(argv)
    print(json.dumps(dict(measure="tail_run", **run(a.seed, a.k, a.longest, a.steps, a.val_interval, a.set))),
          flush=True)


if __name__ == "__main__":
    main()
