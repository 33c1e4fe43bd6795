"""A stateful, resumable loader over dataset indices: which prompts each step uses, on each rank.

The order is a pure function of (seed, epoch): every rank computes the same global batch and
takes its contiguous 1/world_size share, so the union over ranks is the global batch. The state
(epoch, position within the epoch) is global, so a checkpoint taken on 8 ranks resumes on 2 and
the sequence of global batches continues identically. It yields indices only; the dataset is
elsewhere (prompts.py).
"""
from __future__ import annotations

import hashlib

import torch

from phaserl.errors import ConfigError, DataError


def epoch_permutation(num_items: int, *, seed: int, epoch: int) -> list[int]:
    """The item order of one epoch: torch.randperm under a generator seeded by (seed, epoch)."""
    # Hashing the pair (rather than seed + epoch) keeps seed=1/epoch=0 and seed=0/epoch=1 apart.
    digest = hashlib.sha256(f"phaserl-loader:{seed}:{epoch}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randperm(num_items, generator=generator).tolist()


class StatefulLoader:
    """Yields this rank's share of each step's global batch of item indices, epoch after epoch."""

    def __init__(self, num_items: int, batch_size: int, *, seed: int, shuffle: bool = True, rank: int = 0,
                 world_size: int = 1, drop_last: bool = True):
        if num_items < 1:
            raise DataError("the dataset is empty: there are no prompts to load.")
        if batch_size < 1:
            raise ConfigError(f"batch size (prompts per step, global) is {batch_size}; it must be at least 1.")
        if batch_size > num_items:
            raise DataError(
                f"the dataset has {num_items} prompts but a step needs {batch_size} (global); "
                f"lower rollout.prompts_per_step to at most {num_items} or add data."
            )
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside world_size {world_size}.")
        if batch_size % world_size:
            raise ConfigError(
                f"{batch_size} prompts per step do not split evenly over {world_size} ranks; "
                f"use a multiple of {world_size} (e.g. {batch_size - batch_size % world_size or world_size})."
            )
        self.num_items = num_items
        self.batch_size = batch_size  # global: all ranks together
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.position = 0  # items of this epoch's order already handed out (globally)
        self._order_epoch = -1
        self._order: list[int] = []

    @property
    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.num_items, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def _order_of(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            if self.shuffle:
                self._order = epoch_permutation(self.num_items, seed=self.seed, epoch=epoch)
            else:
                self._order = list(range(self.num_items))
            self._order_epoch = epoch
        return self._order

    def next_global_batch(self) -> list[int]:
        """The indices of the next step, all ranks together (advances the state)."""
        remaining = self.num_items - self.position
        if remaining == 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch += 1
            self.position = 0
        order = self._order_of(self.epoch)
        batch = order[self.position:self.position + self.batch_size]
        self.position += len(batch)
        return batch

    def next_batch(self) -> list[int]:
        """This rank's contiguous share of the next step's global batch (advances the state)."""
        batch = self.next_global_batch()
        # An uneven (last, drop_last=False) batch gives the first len % world_size ranks one more.
        per_rank, extra = divmod(len(batch), self.world_size)
        start = self.rank * per_rank + min(self.rank, extra)
        return batch[start:start + per_rank + (1 if self.rank < extra else 0)]

    def state_dict(self) -> dict:
        """The global position plus what it depends on; rank and world size are not part of it."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_items": self.num_items,
                "batch_size": self.batch_size, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where `state` left off; the data and the order settings must match."""
        for key in ("num_items", "seed", "shuffle", "batch_size", "drop_last"):
            if key not in state:
                raise DataError(f"loader state has no '{key}' (keys: {sorted(state)}); was it saved by StatefulLoader?")
            if state[key] != getattr(self, key):
                raise DataError(
                    f"the checkpoint's data loader had {key}={state[key]!r}, this run has {key}="
                    f"{getattr(self, key)!r}; resuming would not continue the same prompt order. Resume with "
                    "the same data files, trainer.seed, data.shuffle and rollout.prompts_per_step, or start a new run."
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.num_items:
            raise DataError(f"loader state epoch={epoch}, position={position} is out of range for "
                            f"{self.num_items} items.")
        self.epoch, self.position = epoch, position
