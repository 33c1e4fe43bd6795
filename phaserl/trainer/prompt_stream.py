"""Phase 1 (prompts): the tokenized prompt dataset behind a resumable, rank-sharded loader."""
from __future__ import annotations

from ..data import StatefulLoader


class PromptStream:
    """`next_items()` yields this rank's share of the next global batch of prompts."""

    def __init__(self, dataset, prompts_per_step: int, *, seed: int, shuffle: bool, rank: int, world_size: int):
        self.dataset = dataset
        self.loader = StatefulLoader(len(dataset.items), prompts_per_step, seed=seed, shuffle=shuffle,
                                     rank=rank, world_size=world_size)

    def next_items(self) -> list:
        return [self.dataset.items[i] for i in self.loader.next_batch()]

    def next_indexed(self) -> list:
        """(dataset index, item) of each prompt `next_items()` would give (advances the same way)."""
        return [(i, self.dataset.items[i]) for i in self.loader.next_batch()]

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
