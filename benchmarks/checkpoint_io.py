"""Checkpoint cost: save (DCP + per-file SHA-256 + manifest), verification (full and size-only), resume.

One JSON line per measurement on stdout. One process, one actor role: a Qwen2 shape (random weights) with
AdamW moments, the state a real run checkpoints. What it answers: how much the manifest's hashing adds to
a save, and what `trainer.checkpoint_verify: full` costs at resume next to `size` (docs/checkpoints.md).
The directory lives under --dir (default: a temporary directory on the same disk as /tmp) and is removed.

    python benchmarks/checkpoint_io.py --shape 0.5b            # on the GPU machine
    python benchmarks/checkpoint_io.py --smoke                  # tiny shape on the CPU, checks the script
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from phaserl.checkpoint import Checkpointer, TrainingState, manifest  # noqa: E402
from phaserl.models import CausalLM  # noqa: E402
from phaserl.roles.optim import Optimizer, OptimSettings  # noqa: E402
from qwen2_shapes import decoder_config  # noqa: E402


def _actor(shape: str, device: str, dtype: torch.dtype):
    model = CausalLM(decoder_config(shape)).to(device=device, dtype=dtype)
    optimizer = Optimizer(model.parameters(), OptimSettings(lr=1e-5))
    for p in model.parameters():            # one step, so that AdamW holds both moments
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return SimpleNamespace(model=model, optimizer=optimizer)


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="0.5b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--dir", default=None, help="where to write (the disk being measured)")
    p.add_argument("--smoke", action="store_true", help="tiny shape on the CPU")
    args = p.parse_args()
    if args.smoke:
        args.shape, args.device, args.dtype = "tiny", "cpu", "float32"
    root = tempfile.mkdtemp(prefix="phaserl-ckpt-bench-", dir=args.dir)
    try:
        actor = _actor(args.shape, args.device, getattr(torch, args.dtype))
        state = TrainingState(step=1, roles={"actor": actor})
        common = dict(shape=args.shape, device=args.device, dtype=args.dtype, torch=torch.__version__)

        saver = Checkpointer(root=root, keep=2, resume_mode="auto", export_hf=False)
        t0 = time.perf_counter()
        path = saver.save(state)
        save_s = time.perf_counter() - t0
        size = _tree_bytes(path)
        gb = size / 1e9
        print(json.dumps({"bench": "checkpoint_save", **common, "bytes": size, "seconds": round(save_s, 3),
                          "gb_per_s": round(gb / save_s, 3)}), flush=True)
        for full in (True, False):
            t0 = time.perf_counter()
            problems = manifest.verify(path, full=full)
            seconds = time.perf_counter() - t0
            assert not problems, problems
            print(json.dumps({"bench": "checkpoint_verify", "mode": "full" if full else "size", **common,
                              "bytes": size, "seconds": round(seconds, 3),
                              "gb_per_s": round(gb / max(seconds, 1e-9), 3)}), flush=True)
        for full in (True, False):
            loader = Checkpointer(root=root, keep=2, resume_mode="auto", export_hf=False, verify_full=full)
            t0 = time.perf_counter()
            info = loader.resume(TrainingState(step=0, roles={"actor": actor}))
            seconds = time.perf_counter() - t0
            loader.close()
            assert info is not None and info.step == 1
            print(json.dumps({"bench": "checkpoint_resume", "verify": "full" if full else "size", **common,
                              "bytes": size, "seconds": round(seconds, 3)}), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
