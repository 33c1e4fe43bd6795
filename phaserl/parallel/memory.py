"""The memory timeline of a step: GPU memory at every phase boundary, for profiles and the docs.

`record_memory(device)` starts a timeline; from then on every `set_phase` (the trainer calls it when a
phase starts) and every hybrid switch of the actor adds one sample: allocated and reserved memory
right then, and the peak allocated since the previous sample (the segment that just ended). To measure
that peak the timeline resets torch's peak statistic at every sample, so while one is recorded
`perf/peak_memory_gb` covers only a step's last segment: it is a profiling tool, off by default.
Nothing is recorded until a timeline is started, and nothing at all off CUDA. `benchmarks/memory_timeline.py`
prints the samples of a 2-GPU run.
Not here: the per-step `perf/peak_memory_gb` metric (trainer/core.py).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

GB = 2 ** 30


@dataclass
class MemorySample:
    label: str                # the phase that starts here, or "switch->rollout" / "switch->training" (its end)
    step: Optional[int]
    seconds: float            # since the timeline started
    allocated_gb: float
    reserved_gb: float
    peak_gb: float            # max allocated since the previous sample (over the segment that ends here)

    def as_dict(self) -> dict:
        return asdict(self)


class MemoryTimeline:
    def __init__(self, device: torch.device):
        self.device = device
        self.t0 = time.perf_counter()
        self.samples: list[MemorySample] = []

    def mark(self, label: str, step: Optional[int] = None) -> None:
        torch.cuda.synchronize(self.device)  # what the queued kernels will have allocated by now
        self.samples.append(MemorySample(
            label, step, round(time.perf_counter() - self.t0, 4),
            torch.cuda.memory_allocated(self.device) / GB, torch.cuda.memory_reserved(self.device) / GB,
            torch.cuda.max_memory_allocated(self.device) / GB))
        torch.cuda.reset_peak_memory_stats(self.device)


_active: Optional[MemoryTimeline] = None


def record_memory(device) -> Optional[MemoryTimeline]:
    """Start (or restart) the timeline on a CUDA device; returns None, recording nothing, elsewhere."""
    global _active
    device = torch.device(device)
    _active = MemoryTimeline(device) if device.type == "cuda" and torch.cuda.is_available() else None
    if _active is not None:
        torch.cuda.reset_peak_memory_stats(device)
    return _active


def stop_recording() -> list[MemorySample]:
    global _active
    samples, _active = (_active.samples if _active is not None else []), None
    return samples


def mark_memory(label: str, step: Optional[int] = None) -> None:
    """One sample on the active timeline (a no-op without one)."""
    if _active is not None:
        _active.mark(label, step)
