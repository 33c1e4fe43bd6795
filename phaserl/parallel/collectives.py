"""Rank and world size, and the reductions the loop uses: each one a no-op in one process.

The training group: with rollout ranks (rollout.ranks, rank_split.py) the trainer ranks train among themselves,
so every reduction here, FSDP's mesh, the checkpoint's collectives and the stop vote run over that group, and
`rank_and_world()` is the rank and count among the trainer ranks. `set_training_group` sets it once for the
process (rank_split.start_rank_split); unset, it is every rank of the launch, as in a colocated run.
`launch_rank_and_world()` is always the whole launch.

Not here: starting the process group (launch.py), sharding (fsdp.py), the gather/reshard pair around the actor's
rollout (gather.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


_training_group = None  # the trainer ranks' process group, when rollout ranks are split off; None = every rank


def set_training_group(group) -> None:
    """The group the trainer's collectives use from now on (None: every rank of the launch)."""
    global _training_group
    _training_group = group


def training_group():
    """The trainer ranks' process group, or None when every rank trains (pass it as `group=`)."""
    return _training_group


def rank_and_world() -> tuple[int, int]:
    """This rank and the rank count among the ranks that train together (the whole launch unless rollout ranks
    are split off)."""
    if is_distributed():
        return dist.get_rank(_training_group), dist.get_world_size(_training_group)
    return 0, 1


def launch_rank_and_world() -> tuple[int, int]:
    """This rank and the world size of the whole launch (trainer and rollout ranks)."""
    if is_distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of `t` over ranks (a copy; `t` itself is left unchanged)."""
    t = t.detach().clone()
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=_training_group)
    return t


def max_over_ranks(value: int) -> int:
    """The largest `value` of any rank (itself in one process): sharded forwards run in lockstep, so a
    rank with fewer batches than another pads up to this count."""
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_training_group)
    return int(t.item())


def reduce_metrics(metrics: dict) -> dict:
    """One metrics dict for the whole run from every rank's own (identical on every rank afterwards).

    Keys ending in `_max` / `_min` take the max / min over ranks, `timing_s/*` the max (the slowest rank
    sets the pace), everything else the mean over the ranks that have the key (ranks hold equal numbers
    of responses, so a mean of per-rank response means is the global mean; per-source keys may be
    missing on some ranks). Values that are already global (identical on every rank) pass unchanged.
    """
    if not is_distributed():
        return dict(metrics)
    gathered = [None] * dist.get_world_size(_training_group)
    dist.all_gather_object(gathered, {k: float(v) for k, v in metrics.items()}, group=_training_group)
    out = {}
    for key in sorted(set().union(*gathered)):
        values = [g[key] for g in gathered if key in g]
        if key.endswith("_max") or key.startswith("timing_s/"):
            out[key] = max(values)
        elif key.endswith("_min"):
            out[key] = min(values)
        else:
            out[key] = sum(values) / len(values)
    return out
