"""Make a bigger card look like a smaller one to a benchmark: a second process holds the difference.

`torch.cuda.mem_get_info` reports the device's free memory across processes, so with a process holding
(total - target) bytes, phaserl's memory plan, its KV budget and every allocation see a card of `target` GiB, as
they would on the smaller card (an H200 holding 60.2 GiB behaves like an H100's 79.6 GiB). Speed is still the
bigger card's: its memory bandwidth and clocks. Used by memory_plan.py --card-gib.

    python benchmarks/card_size.py 79.6     # holds the difference until killed (prints one JSON line when ready)
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import torch

GIB = 2**30
H100_80GB_GIB = 79.6  # what an H100 80 GB reports as its total (81,559 MiB)


def hold(target_gib: float) -> None:
    """Allocate the device's total minus `target_gib` and wait (the child process's body)."""
    free, total = torch.cuda.mem_get_info()
    extra = int(total - target_gib * GIB)
    if extra > 0:
        ballast = torch.empty(extra, dtype=torch.uint8, device="cuda")
        ballast.fill_(1)  # touch it: the driver commits the pages
        torch.cuda.synchronize()
    print(json.dumps({"bench": "card_size", "held_gib": round(max(extra, 0) / GIB, 2),
                      "total_gib": round(total / GIB, 2), "looks_like_gib": target_gib}), flush=True)
    while True:
        time.sleep(3600)


class SmallerCard:
    """A context manager: while inside, this process's device looks like a card of `target_gib` (no-op off CUDA
    or when the card is already that small)."""

    def __init__(self, target_gib: float):
        self.target_gib, self.proc = target_gib, None

    def __enter__(self):
        if torch.cuda.is_available() and torch.cuda.mem_get_info()[1] > self.target_gib * GIB:
            self.proc = subprocess.Popen([sys.executable, __file__, str(self.target_gib)], stdout=subprocess.PIPE,
                                         text=True)
            ready = self.proc.stdout.readline()  # blocks until the child holds its memory
            if not ready:
                raise RuntimeError("card_size: the holding process exited before it was ready")
            print(ready.strip(), flush=True)
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    hold(float(sys.argv[1]))
