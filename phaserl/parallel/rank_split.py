"""Rollout ranks: the last `rollout.ranks` ranks of a torchrun launch only generate, the others only train.

`RankSplit(world_size, rollout_ranks)` says which rank does what; `build_groups(split, timeout_s)` makes the
process groups the two sides use, every one with the collective timeout:

    trainer   the trainer ranks: FSDP2's mesh (`trainer_mesh`) and the trainer's reductions
    rollout   the rollout ranks among themselves
    sync      trainer rank 0 and every rollout rank: the weight buckets (weight_sync.py). NCCL when each of
              these ranks has a GPU of its own; gloo otherwise (the CPU, or two processes sharing one GPU,
              which NCCL refuses: CUDA tensors are then staged through host memory)
    control   the same ranks over gloo: version headers (polled without blocking) and the one-time check that
              both sides hold the same parameters
    samples   per rollout rank r, gloo over [0, r]: its completed sample groups to trainer rank 0 (a group of
              two, so that a broadcast from r is a message whose failure a poll sees: sample_channel.py)
    trainer_cpu  the trainer ranks over gloo: trainer rank 0 hands out the sample groups

`start_rank_split(rollout_ranks)` does it once for the process and makes the trainer group the process's training
group (collectives.set_training_group): from then on the trainer's reductions, FSDP's mesh, checkpoints and the
stop vote run among the trainer ranks, and `rank_and_world()` counts them alone. A rollout rank keeps its global
rank there (it never logs or writes checkpoints; rank 0 does).

Why the last ranks: global rank 0 stays trainer rank 0, the rank that logs, writes checkpoints and prints, as
in a colocated run; the trainer ranks are 0 .. T-1 in the same order as the global ones.
`rollout.ranks: 0` (the default) is the colocated run: every rank samples and trains (HybridActor), and
nothing here is used. Not here: what each side runs (the trainer), the transfers (weight_sync.py,
sample_channel.py), the checks of a config against the launch (config/validate.py).
"""
from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

log = logging.getLogger("phaserl")


@dataclass(frozen=True)
class RankSplit:
    """Which ranks of a launch of `world_size` train and which generate (the last `rollout_ranks`)."""

    world_size: int
    rollout_ranks: int  # k: the last k ranks generate; 0 = colocated (every rank does both)

    def __post_init__(self):
        k, world = self.rollout_ranks, self.world_size
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"rollout_ranks = {k!r}: expected an integer >= 0 (0 = every rank samples and trains)")
        if k and world < 2:
            raise ValueError(f"rollout_ranks = {k} needs a torchrun launch of at least 2 ranks; this world has "
                             f"{world}")
        if k >= world and k:
            raise ValueError(f"rollout_ranks = {k} of a world of {world} leaves no trainer rank; use at most "
                             f"{world - 1}")

    @property
    def colocated(self) -> bool:
        return self.rollout_ranks == 0

    @property
    def num_trainers(self) -> int:
        return self.world_size - self.rollout_ranks

    @property
    def trainers(self) -> list[int]:
        """Global ranks that train: 0 .. T-1 (trainer rank r is global rank r)."""
        return list(range(self.num_trainers))

    @property
    def rollouts(self) -> list[int]:
        """Global ranks that only generate: T .. world-1 (empty when colocated)."""
        return list(range(self.num_trainers, self.world_size)) if self.rollout_ranks else []

    def role(self, rank: int) -> str:
        """'trainer', 'rollout', or 'both' (colocated)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        if self.colocated:
            return "both"
        return "rollout" if rank >= self.num_trainers else "trainer"


@dataclass
class RankGroups:
    """The process groups of one rank (None where this rank is not a member)."""

    split: RankSplit
    rank: int
    timeout_s: float
    sync_backend: str                       # nccl | gloo: how the weight buckets travel
    trainer: Optional[dist.ProcessGroup]
    rollout: Optional[dist.ProcessGroup]
    sync: Optional[dist.ProcessGroup]       # trainer rank 0 + rollout ranks, sync_backend
    control: Optional[dist.ProcessGroup]    # trainer rank 0 + rollout ranks, gloo
    samples: dict                           # rollout rank r -> gloo group [0, r] (the ones this rank is in)
    trainer_cpu: Optional[dist.ProcessGroup]  # the trainer ranks, gloo

    @property
    def role(self) -> str:
        return self.split.role(self.rank)

    @property
    def sender_rank(self) -> int:
        """The global rank that sends weights and receives samples: trainer rank 0."""
        return 0

    @property
    def sync_ranks(self) -> list[int]:
        return [self.sender_rank] + self.split.rollouts


def _device_key() -> tuple:
    """(host, GPU index) of this rank; the GPU is -1 on the CPU."""
    gpu = torch.cuda.current_device() if torch.cuda.is_available() and "nccl" in dist.get_backend() else -1
    return socket.gethostname(), gpu


def choose_sync_backend(split: RankSplit) -> str:
    """nccl when the sync ranks each have a GPU of their own, else gloo (a collective over every rank)."""
    keys = [None] * split.world_size
    dist.all_gather_object(keys, _device_key())
    members = [keys[r] for r in [0] + split.rollouts]
    if any(gpu < 0 for _, gpu in members):
        return "gloo"
    if len(set(members)) < len(members):  # NCCL refuses two ranks on one GPU ("Duplicate GPU detected")
        shared = sorted({r for r in [0] + split.rollouts if members.count(keys[r]) > 1})
        log.warning(f"ranks {shared} share a GPU: weights travel over gloo, staged through host memory "
                    "(slower than NCCL between GPUs of their own)")
        return "gloo"
    return "nccl"


def build_groups(split: RankSplit, timeout_s: float, *, sync_backend: str = "auto") -> RankGroups:
    """Make the trainer / rollout / sync / control / samples groups; every rank must call this, in the same order.

    sync_backend: auto (choose_sync_backend), nccl or gloo. Needs a running default process group whose world
    size is split.world_size (launch.init_distributed).
    """
    if not dist.is_initialized():
        raise RuntimeError("build_groups needs torch.distributed started (launch.init_distributed under torchrun)")
    if dist.get_world_size() != split.world_size:
        raise ValueError(f"the split is for {split.world_size} ranks but the launch has {dist.get_world_size()}")
    if split.colocated:
        raise ValueError("rollout_ranks = 0: every rank samples and trains, there are no rollout ranks to group")
    if sync_backend not in ("auto", "nccl", "gloo"):
        raise ValueError(f"sync_backend = {sync_backend!r}: expected auto, nccl or gloo")
    if sync_backend == "auto":
        sync_backend = choose_sync_backend(split)
    timeout = timedelta(seconds=timeout_s)
    rank = dist.get_rank()
    sync_ranks = [0] + split.rollouts

    def group(ranks: list[int], backend: Optional[str] = None) -> Optional[dist.ProcessGroup]:
        made = dist.new_group(ranks, timeout=timeout, backend=backend)  # collective: every rank, same order
        return made if rank in ranks else None

    trainer, rollout = group(split.trainers), group(split.rollouts)
    sync, control = group(sync_ranks, sync_backend), group(sync_ranks, "gloo")
    samples = {r: group([0, r], "gloo") for r in split.rollouts}
    groups = RankGroups(split=split, rank=rank, timeout_s=float(timeout_s), sync_backend=sync_backend,
                        trainer=trainer, rollout=rollout, sync=sync, control=control,
                        samples={r: g for r, g in samples.items() if g is not None},
                        trainer_cpu=group(split.trainers, "gloo"))
    if rank == 0:
        log.info(f"[rank 0] rollout ranks {split.rollouts}, trainer ranks {split.trainers}; weights over "
                 f"{sync_backend}, collective timeout {timeout_s:g} s")
    return groups


_started: Optional[RankGroups] = None


def start_rank_split(rollout_ranks: int, timeout_s: float) -> Optional[RankGroups]:
    """The process's rank split (made once: every rank of the launch calls it, the same way): the groups, with the
    trainer group set as the training group on the trainer ranks. None when colocated (rollout_ranks = 0) or in one
    process. timeout_s: the collective timeout (launch.collective_timeout_s(): the process group's own)."""
    global _started
    if not rollout_ranks or not dist.is_initialized():
        return None
    if _started is not None:
        if _started.split.rollout_ranks != rollout_ranks:
            raise ValueError(f"this process already split off {_started.split.rollout_ranks} rollout ranks; "
                             f"asked for {rollout_ranks}")
        return _started
    from .collectives import set_training_group

    groups = build_groups(RankSplit(dist.get_world_size(), rollout_ranks), timeout_s)
    if groups.trainer is not None:
        set_training_group(groups.trainer)
    _started = groups
    return groups


def rank_groups() -> Optional[RankGroups]:
    """The groups start_rank_split made for this process, or None (colocated, one process)."""
    return _started


def end_rank_split() -> None:
    """Forget the split (before the process group is destroyed): the training group is every rank again."""
    global _started
    from .collectives import set_training_group

    _started = None
    set_training_group(None)


def trainer_mesh(groups: RankGroups, device_type: str):
    """A 1-D DeviceMesh over the trainer ranks, for FSDP2 (`fully_shard(..., mesh=...)`); trainer ranks only."""
    from torch.distributed.device_mesh import DeviceMesh

    if groups.trainer is None:
        raise ValueError(f"rank {groups.rank} is a rollout rank: only trainer ranks build the trainer mesh")
    return DeviceMesh.from_group(groups.trainer, device_type, mesh_dim_names=("shard",))
