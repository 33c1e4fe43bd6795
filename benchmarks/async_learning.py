"""Learning with the asynchronous stream on the tiny worlds (CPU): the held-out score and wall time per bound k.

For each world (the quickstart's arithmetic, the multi-turn retry agent), each seed and each
rollout.max_staleness k, one full quickstart run (`phaserl train <world>.yaml trainer.seed=S
rollout.max_staleness=K`); one JSON line per run (final val/score_mean, the best, wall seconds, mean staleness)
and a summary line per (world, k): the mean final score over seeds and its gap to k = 0.

    python benchmarks/async_learning.py                          # both worlds, seeds 0 1 2, k 0 1 2
    python benchmarks/async_learning.py --worlds arith --seeds 0 --ks 0 1
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", nargs="+", default=["arith", "agent"], choices=["arith", "agent"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more overrides for every run")
    a = p.parse_args(argv)
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
