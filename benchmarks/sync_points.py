"""Where the host waits for the GPU: every synchronizing CUDA call of a training step, by source line.

A host sync drains the GPU's queue; until the host has queued work again the GPU idles. This runs
(1) the packed, compiled actor loss step of benchmarks/train_step.py and (2) whole GRPO trainer steps
(rollout, reference, update) on a tiny world, with torch.cuda.set_sync_debug_mode("warn"), and prints
one JSON line per distinct call site (the innermost phaserl/benchmarks frame) with its count per step.

    python benchmarks/sync_points.py            # CUDA (counts)
    python benchmarks/sync_points.py --dry      # CPU: runs the same code, counts nothing (checks the script)
"""
from __future__ import annotations

import collections
import json
import os
import sys
import tempfile
import traceback
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]


def _site() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if ROOT in f.filename and "sync_points" not in f.filename]
    if not frames:
        return "outside phaserl"
    return " <- ".join(f"{os.path.relpath(f.filename, ROOT)}:{f.lineno}" for f in reversed(frames[-3:]))


def count_syncs(fn, steps: int) -> collections.Counter:
    fn()  # warm-up (compilation, lazy init) is not counted
    if DEVICE.type != "cuda":
        return collections.Counter()
    torch.cuda.synchronize()
    sites: collections.Counter = collections.Counter()
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message).lower():
            sites[_site()] += 1
        else:
            original(message, category, filename, lineno, file, line)

    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            for _ in range(steps):
                fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = original
    return sites


def emit(part: str, sites: collections.Counter, steps: int) -> None:
    for site, n in sites.most_common():
        print(json.dumps({"part": part, "per_step": n / steps, "site": site}), flush=True)
    print(json.dumps({"part": part, "total_per_step": sum(sites.values()) / steps}), flush=True)


def actor_step() -> None:
    import train_step
    from phaserl.models.decoder import enable_compile

    class Args:
        shape, dtype = "tiny", "bf16"
    model = train_step.build_model("packed", Args, DEVICE)
    enable_compile(model)
    batch = train_step.make_batch("longtail", 64, 32, 64, model.config.vocab_size, DEVICE)
    adv = torch.randn(batch.response_mask.shape, device=DEVICE)

    def step():
        model.zero_grad(set_to_none=True)
        train_step.ours_step(model, batch, adv, 1024, True)
    emit("actor_loss_step", count_syncs(step, 2), 2)


def grpo_steps() -> None:
    import yaml

    import grpo_step
    from phaserl.config import load_config
    from phaserl.trainer import RLTrainer

    a = grpo_step.parse_args(["--tiny", "--only", "ours"])
    root = grpo_step.make_world(a)
    log_dir = tempfile.mkdtemp(prefix="sync_points_")
    path = os.path.join(log_dir, "ours.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(grpo_step.ours_config(a, root, log_dir), f)
    trainer = RLTrainer.from_config(load_config(path, ["actor.compile=true", "rollout.engine_keep_awake=true",
                                                       "trainer.total_steps=10"]))

    def step():
        trainer.train_step()
        trainer.step_num += 1
    emit("grpo_step", count_syncs(step, 2), 2)


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

if __name__ == "__main__":
    if DEVICE.type != "cuda" and "--dry" not in sys.argv:
        sys.exit("sync_points.py needs a CUDA device (or --dry)")
    actor_step()
    grpo_steps()
