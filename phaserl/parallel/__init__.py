"""torch.distributed helpers: rank/world size, and reductions that are no-ops in one process.

One process (no launcher) is the default; under torchrun every rank runs the same program (SPMD).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    if is_distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of `t` over ranks (a copy; `t` itself is left unchanged)."""
    t = t.detach().clone()
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
