"""Heavy-tailed response lengths: the synchronous step against the asynchronous stream, one trainer, one run.

One JSON line per measurement on stdout. Shape: Qwen2-0.5B architecture (random weights, bf16), 64 prompts x 8
samples per step, prompt 128 tokens, each response's length drawn from a heavy tail (90% uniform in [32, 512],
8% in [512, 2048], 2% exactly 4,096: EOS is ignored and the length is the sample's cap), GRPO with phaserl's
defaults otherwise. The same trainer runs every case in turn (`rollout.max_staleness` is the stream it reads
from: RunSettings.stream is swapped between cases), in the order sync, async k..., sync again, so a run-order
effect shows as two different sync numbers.

Lengths: the sync path's generate calls get per-sample caps (RolloutEngine.generate's max_new_tokens list); the
async path's session draws a sample's length when the sample first starts (a sample started over draws anew).
Both draw from the same distribution with their own seeded generator.

Per case: trained_tokens_per_s (sampled tokens in the batches the update trained on / wall of the timed steps),
s_per_step, the phase split, the staleness metrics, restarted and cut samples, and gpu_busy (the mean of
torch.cuda.utilization() sampled every 50 ms during the timed steps; null where NVML is missing).

    python benchmarks/long_tail.py                       # GPU: 0.5b, sync vs async k = 1 and 3 (k = 2 decodes as 1)
    python benchmarks/long_tail.py --tiny --steps 2      # CPU smoke test
    python benchmarks/long_tail.py --ks 3 --max-run-keys 0      # no decode-attention run bound (one process each)
    python benchmarks/long_tail.py --ks 3 --no-row-runs         # one bounded run count for every row (no row runs)
    python benchmarks/long_tail.py --ks 1 --partial-kv keep prefill   # partial responses kept vs re-prefilled

--partial-kv: the async cases' rollout.partial_kv (default auto: keep when the engine is kept awake, as a user's run
chooses); keep needs rollout.engine_keep_awake on (`--set rollout.engine_keep_awake=true` on the CPU). Each case's
line counts kept_sequences, reprefill_tokens and lost_sessions (a kept session lost between steps).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import grpo_step  # noqa: E402  (the world and phaserl's config for the GRPO shapes)


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def draw_length(rng: random.Random, longest: int) -> int:
    """90% in [32, 512], 8% in [512, 2048], 2% the longest (scaled down with --tiny)."""
    u = rng.random()
    scale = longest / 4096
    if u < 0.90:
        return max(1, int(rng.randint(32, 512) * scale))
    if u < 0.98:
        return max(1, int(rng.randint(512, 2048) * scale))
    return longest


class LengthTail:
    """Puts the drawn lengths into both rollout paths of one trainer (the engine's per-sample caps)."""

    def __init__(self, trainer, longest: int):
        self.longest, self.rng = longest, random.Random(0)
        self.by_key: dict = {}
        actor = trainer.actor
        generate, session = actor.engine_generate_original, actor.decode_session

        def capped_generate(prompts, params, **kwargs):
            return generate(prompts, params, max_new_tokens=[self.draw() for _ in prompts], **kwargs)
        actor.engine.generate = capped_generate

        def capped_session(*args, **kwargs):
            if kwargs.get("keep"):  # a session kept across phases (rollout.partial_kv=keep): the object itself
                return cap_starts(session(*args, **kwargs), self)
            return CappedSession(session(*args, **kwargs), self)
        actor.decode_session = capped_session

    def draw(self) -> int:
        return draw_length(self.rng, self.longest)


class CappedSession:
    """A decode session whose samples stop at their drawn length: `tail` has draw(), `longest` (the run's
    max_new_tokens) and by_key (a sample's length, kept when it continues after a cut)."""

    def __init__(self, inner, tail):
        self.inner, self.tail = inner, tail

    def __enter__(self):
        return cap_starts(self.inner.__enter__(), self.tail)

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


def cap_starts(s, tail):
    """Session `s` with its start() capping each sample at its drawn length (a kept session's paused samples are not
    started again: they keep the cap they started with)."""
    start = s.start

    def capped_start(key, prompt_ids, cap, noise_key=None):
        if key not in tail.by_key:  # drawn once: setdefault would draw (and advance the generator) every time
            tail.by_key[key] = tail.draw()
        target = tail.by_key[key]
        done = tail.longest - cap   # ids sampled before this phase (cap = max_new_tokens - done)
        return start(key, prompt_ids, max(1, min(cap, target - done)), noise_key=noise_key)
    s.start = capped_start
    return s


class BusySampler:
    def __init__(self):
        self.values, self.stop = [], threading.Event()
        try:
            torch.cuda.utilization()
            self.ok = torch.cuda.is_available()
        except Exception:  # noqa: BLE001 - NVML missing: report null
            self.ok = False
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.is_set():
            self.values.append(torch.cuda.utilization())
            time.sleep(0.05)

    def __enter__(self):
        if self.ok:
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        if self.ok:
            self.thread.join()

    @property
    def mean(self):
        return round(statistics.mean(self.values) / 100, 3) if self.values else None


def run_case(trainer, name: str, k: int, a, partial_kv: str = "prefill") -> dict:
    from phaserl.trainer.build import rollout_stream

    cfg = dataclasses.replace(a.cfg, rollout=dataclasses.replace(a.cfg.rollout, max_staleness=k))
    trainer.run.stream.close()  # the last case's kept session (if any) gives its slots back
    trainer.run = dataclasses.replace(trainer.run, stream=rollout_stream(
        cfg, trainer.run.train_prompts.dataset, prompts_per_rank=a.prompts, partial_kv=partial_kv))
    steps, phases_seen = [], 0
    for i in range(a.warmup + a.steps):
        timed = i >= a.warmup
        if timed and i == a.warmup:
            busy = BusySampler().__enter__()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        before = trainer.actor.engine.last_stats
        metrics = trainer.train_step()
        trainer.step_num += 1
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        trained = metrics["train/response_length_mean"] * a.prompts * a.n
        # async: the tokens this step's rollout phase decoded (a step whose batch was ready decodes none); sync: all
        # sampled tokens are the trained ones
        after = trainer.actor.engine.last_stats
        kept = getattr(trainer.run.stream, "session", None)  # partial_kv=keep: one session, its per-phase counts
        if kept is not None:
            after, phases_seen = (kept.last_phase if kept.phases != phases_seen else before), kept.phases
        sampled = trained if not k else (after.get("new_tokens", 0) if after is not before else 0)
        step = dict(measure="step", case=name, step=i, warmup=not timed, seconds=round(seconds, 3),
                    trained_tokens=round(trained), sampled_tokens=round(sampled),
                    timing_s={k2.split("/", 1)[1]: round(v, 3) for k2, v in metrics.items()
                              if k2.startswith("timing_s/")},
                    **{key: metrics[key] for key in metrics if key.startswith("async/")})
        if after is not before:  # this step's rollout: its decode steps and the rows they ran (what they cost)
            step.update(decode_steps=after.get("steps"), stepped_rows=after.get("stepped_rows"),
                        rows_per_step=round(after.get("stepped_rows", 0) / max(after.get("steps", 1), 1), 1))
        steps.append(step)
        emit(**step)
    busy.__exit__()
    timed = [s for s in steps if not s["warmup"]]
    wall = sum(s["seconds"] for s in timed)
    tokens = sum(s["trained_tokens"] for s in timed)
    summary = dict(measure="case", case=name, max_staleness=k, partial_kv=partial_kv if k else None,
                   steps_timed=len(timed),
                   kept_sequences=sum(s.get("async/kept_sequences", 0) for s in timed),
                   reprefill_tokens=sum(s.get("async/reprefill_tokens", 0) for s in timed),
                   lost_sessions=sum(s.get("async/lost_sessions", 0) for s in timed),
                   trained_tokens_per_s=round(tokens / wall), s_per_step=round(wall / len(timed), 3),
                   sampled_tokens_per_s=round(sum(s["sampled_tokens"] for s in timed) / wall),
                   gpu_busy=busy.mean,
                   timing_s={p: round(statistics.mean(s["timing_s"].get(p, 0.0) for s in timed), 3)
                             for p in timed[0]["timing_s"]},
                   restarted_samples=sum(s.get("async/restarted_samples", 0) for s in timed),
                   staleness_mean=round(statistics.mean(s.get("async/staleness_mean", 0.0) for s in timed), 3))
    # the sequences decoded at once: the stream's session slots (async), the last generate call's (sync)
    summary["slots"] = getattr(trainer.run.stream, "slots", None) or trainer.actor.engine.last_stats.get("slots")
    summary["kv_pool_tokens"] = trainer.actor.engine.pool.capacity_tokens
    emit(**summary)
    return summary


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU-sized model and batch (smoke test)")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 3], help="max_staleness values of the async cases (k = 2 "
                   "decodes as k = 1: trainer/stream.py's lookahead)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per case")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per case (the async stream fills up)")
    p.add_argument("--longest", type=int, default=None, help="the tail's length (4096; --tiny 64)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (64; --tiny 4)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt (8; --tiny 4)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (every case)")
    p.add_argument("--sync-once", action="store_true", help="measure the synchronous case once (default: first and "
                   "last, to show a run-order effect)")
    p.add_argument("--partial-kv", nargs="+", choices=["auto", "keep", "prefill"], default=["auto"],
                   help="each async case with these rollout.partial_kv modes in turn (A/B: keep prefill); auto = what "
                        "a user gets: keep when the engine is kept awake (rollout.engine_keep_awake), else prefill")
    p.add_argument("--max-run-keys", type=int, default=None, help="rollout/kernels.py's MAX_RUN_KEYS for this run "
                   "(the decode attention's bound on the keys one program walks in long slots; 0: no bound; "
                   "default: the product's)")
    p.add_argument("--no-row-runs", dest="row_runs", action="store_false", help="rollout/kernels.py's ROW_RUNS off "
                   "(default on: runs of MAX_RUN_KEYS keys, as many as each row needs)")
    a = p.parse_args(argv)
    a.device = "cuda" if torch.cuda.is_available() and not a.tiny else "cpu"
    from phaserl.rollout import kernels

    if a.max_run_keys is not None:
        kernels.MAX_RUN_KEYS = a.max_run_keys or None
    kernels.ROW_RUNS = a.row_runs
    a.longest = a.longest or (64 if a.tiny else 4096)
    prompts, n = a.prompts or (4 if a.tiny else 64), a.n or (4 if a.tiny else 8)
    args = ["--shape", "0.5b", "--prompts", str(prompts), "--n", str(n),
            "--prompt-len", "16" if a.tiny else "128", "--new-tokens", str(a.longest),
            "--steps", str(len(a.ks) * (a.warmup + a.steps) + 2 * (a.warmup + a.steps) + 2)]
    g = grpo_step.parse_args(args + (["--tiny"] if a.tiny else []))
    a.prompts, a.n = g.prompts, g.n
    root = grpo_step.make_world(g)
    log_dir = os.path.join(root, "long_tail_logs")
    cfg_dict = grpo_step.ours_config(g, root, log_dir)
    cfg_dict["rollout"]["ignore_eos"] = True
    # the product's KV defaults (engine_memory_fraction 0.4, engine_max_slots 512), not grpo_step's 0.03 sized for its
    # 256-token responses: that holds 47 slots of 4,224 tokens on an H100 and starves the synchronous case
    cfg_dict["rollout"].pop("engine_memory_fraction", None)
    cfg_dict["rollout"].pop("engine_max_slots", None)
    cfg_dict["ppo"]["micro_batch_tokens"] = "auto"
    cfg_dict["trainer"]["total_steps"] = 10_000
    import yaml

    from phaserl.config import load_config
    from phaserl.trainer import RLTrainer

    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, "long_tail.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg_dict, f, sort_keys=False)
    a.cfg = load_config(path, a.set)
    trainer = RLTrainer.from_config(a.cfg)
    with trainer.actor.rollout_mode():
        trainer.actor._ensure_engine()
    trainer.actor.engine_generate_original = trainer.actor.engine.generate
    LengthTail(trainer, a.longest)
    emit(measure="setup", device=torch.cuda.get_device_name() if a.device == "cuda" else "cpu", torch=torch.__version__,
         prompts=a.prompts, n=a.n, longest=a.longest, ks=a.ks, overrides=a.set,
         engine_memory_fraction=a.cfg.rollout.engine_memory_fraction, engine_max_slots=a.cfg.rollout.engine_max_slots,
         max_run_keys=kernels.MAX_RUN_KEYS, row_runs=kernels.ROW_RUNS)
    from phaserl.config.auto import partial_kv_choice

    kept_awake = trainer.actor.engine.config.keep_awake
    modes = [partial_kv_choice(m, max_staleness=1, rollout_ranks=0, keep_awake=kept_awake).value for m in a.partial_kv]
    named = len(modes) > 1  # several modes: each async case's name says which
    cases = [("sync", 0, "prefill")] + [(f"async_k{k}" + (f"_{m}" if named else ""), k, m) for k in a.ks for m in modes]
    cases += [] if a.sync_once else [("sync_again", 0, "prefill")]
    results = [run_case(trainer, name, k, a, mode) for name, k, mode in cases]
    sync = statistics.mean(r["trained_tokens_per_s"] for r in results if r["max_staleness"] == 0)
    emit(measure="summary", sync_trained_tokens_per_s=round(sync),
         speedup={r["case"]: round(r["trained_tokens_per_s"] / sync, 3) for r in results if r["max_staleness"]},
         sampled_speedup={r["case"]: round(r["sampled_tokens_per_s"] / sync, 3) for r in results
                          if r["max_staleness"]})


if __name__ == "__main__":
    main()
