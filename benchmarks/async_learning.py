"""Learning with the asynchronous stream on the tiny worlds (CPU): the held-out score and wall time per bound k.

For each world (the quickstart's arithmetic, the multi-turn retry agent), each seed and each
rollout.max_staleness k, one full quickstart run (`phaserl train <world>.yaml trainer.seed=S
rollout.max_staleness=K`); one JSON line per run (final val/score_mean, the best, wall seconds, mean staleness)
and a summary line per (world, k): the mean final score over seeds and its gap to k = 0.

--tail LONGEST: the arithmetic world with heavy-tailed response lengths up to LONGEST tokens (tail_learning.py, one
fresh process per run, seeds outer so that sync and async runs interleave on a shared machine). Per run: the
held-out score at every validation with the training wall and CPU seconds so far, the final score, and the wall
seconds to reach the same seed's synchronous final score and each --levels score (null if never); per k: the
means over seeds.

    python benchmarks/async_learning.py                          # both worlds, seeds 0 1 2, k 0 1 2
    python benchmarks/async_learning.py --worlds arith --seeds 0 --ks 0 1
    python benchmarks/async_learning.py --tail 48 --ks 0 1 3     # long-tail arithmetic, sync vs async
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def one_run(world: str, seed: int, k: int, extra: list) -> dict:
    from phaserl.cli import QUICKSTART_CONFIGS

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "phaserl", "train", QUICKSTART_CONFIGS[world], f"trainer.seed={seed}",
               f"rollout.max_staleness={k}", f"trainer.log_dir={tmp}/logs", f"trainer.checkpoint_path={tmp}/ckpt",
               "trainer.loggers=[jsonl]", *extra]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        seconds = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        lines = [json.loads(line) for line in open(os.path.join(tmp, "logs", "metrics.jsonl"))]
    vals = [m["val/score_mean"] for m in lines if "val/score_mean" in m]
    stale = [m["async/staleness_mean"] for m in lines if "async/staleness_mean" in m]
    return dict(world=world, seed=seed, max_staleness=k, val_start=vals[0], val_final=vals[-1], val_best=max(vals),
                seconds=round(seconds, 1), staleness_mean=round(statistics.mean(stale), 3) if stale else 0.0)


def tail_run(seed: int, k: int, a) -> dict:
    steps = a.steps if k == 0 else a.async_steps or a.steps
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "tail_learning.py"), "--seed", str(seed), "--k", str(k),
           "--longest", str(a.tail), "--steps", str(steps), "--val-interval", str(a.val_interval),
           *[arg for item in a.set for arg in ("--set", item)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return next(json.loads(line) for line in proc.stdout.splitlines() if '"measure": "tail_run"' in line)


def reach_wall(series: list, target: float):
    """Training wall seconds at the first validation scoring at least `target`, or None."""
    return next((p["wall_s"] for p in series if p["val"] >= target - 1e-9), None)


def tail_main(a) -> None:
    ks = sorted(set(a.ks))
    if ks[0] != 0:
        raise ValueError(f"--tail compares against the synchronous run: --ks {' '.join(map(str, a.ks))} needs a 0")
    runs = []
    for seed in a.seeds:
        sync = None
        for k in ks:
            r = tail_run(seed, k, a)
            sync = r["val_final"] if k == 0 else sync
            r["reach_sync_wall_s"] = reach_wall(r["series"], sync)
            r["reach_wall_s"] = {str(level): reach_wall(r["series"], level) for level in a.levels}
            runs.append(r)
            emit(**r)
    for k in ks:
        mine = [r for r in runs if r["max_staleness"] == k]
        reached = [r["reach_sync_wall_s"] for r in mine if r["reach_sync_wall_s"] is not None]
        emit(measure="tail_summary", max_staleness=k, longest=a.tail, steps=mine[0]["steps"], seeds=a.seeds,
             val_final_mean=round(statistics.mean(r["val_final"] for r in mine), 4),
             reached=len(reached), reach_sync_wall_s_mean=round(statistics.mean(reached), 2) if reached else None,
             train_wall_s_mean=round(statistics.mean(r["train_wall_s"] for r in mine), 2),
             **{key: round(statistics.mean(r["per_step"][key] for r in mine), 3)
                for key in ("step_s", "rollout_s", "update_s", "decode_steps", "rows_per_decode_step", "staleness")})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", nargs="+", default=["arith", "agent"], choices=["arith", "agent"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more overrides for every run")
    p.add_argument("--tail", type=int, default=None, metavar="LONGEST", help="long-tail arithmetic: responses up to "
                   "LONGEST tokens (the tiny model holds 64 positions: 48 with the world's 16-token prompts)")
    p.add_argument("--steps", type=int, default=40, help="--tail: training steps per run")
    p.add_argument("--async-steps", type=int, default=None, help="--tail: training steps of the k >= 1 runs (default "
                   "--steps; more lets a run that learns slower per step still reach the synchronous final score)")
    p.add_argument("--val-interval", type=int, default=1, help="--tail: validate every this many steps")
    p.add_argument("--levels", type=float, nargs="*", default=[0.9], help="--tail: held-out scores whose time to "
                   "reach each run reports as well (fixed levels, beside the synchronous final score)")
    a = p.parse_args(argv)
    if a.tail is not None:
        return tail_main(a)
    for world in a.worlds:
        finals = {}
        for k in a.ks:
            for seed in a.seeds:
                r = one_run(world, seed, k, a.set)
                finals.setdefault(k, []).append(r["val_final"])
                emit(measure="run", **r)
        sync = statistics.mean(finals[0]) if 0 in finals else None
        for k, scores in finals.items():
            mean = statistics.mean(scores)
            emit(measure="summary", world=world, max_staleness=k, seeds=a.seeds, val_final_mean=round(mean, 4),
                 gap_to_sync=None if sync is None else round(mean - sync, 4))


if __name__ == "__main__":
    main()
