"""Scheduler: which sequence occupies which KV slot, and when waiting sequences take freed slots.

Host-side bookkeeping only (no tensors): sequences wait in prompt order; `admit()` gives free slots,
lowest first, to waiting sequences (continuous refill: a slot freed by a finished sequence is taken
at the next step, so long responses never leave the batch idle). Admissions are batched until
`admit_threshold` slots are free, so that prefills are not one sequence at a time. With
`refill=False` the scheduler behaves like static batching (admit only when nothing runs), which the
benchmark uses to measure what refill gains. `compact()` moves sequences from high slots into low
free ones so that decode can run a smaller bucket once the batch drains.
Not here: tensors and the forward pass (runner.py), stop conditions (evaluated on the device).
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass


@dataclass(eq=False)
class Sequence:
    index: int                    # position in the caller's prompt list
    prompt: tuple[int, ...]
    max_new_tokens: int
    slot: int = -1
    done: bool = False
    media: object = None          # the prompt's images (vision prompts): part of what a shared prefill shares


class Scheduler:
    def __init__(self, sequences: list[Sequence], num_slots: int, *, refill: bool = True, admit_threshold: int = 1):
        self.waiting = deque(sequences)
        self.running: dict[int, Sequence] = {}  # slot -> sequence
        self.free = list(range(num_slots))  # a heap: the lowest free slot first
        self.refill, self.admit_threshold = refill, max(1, admit_threshold)

    @property
    def all_done(self) -> bool:
        return not self.waiting and not self.running

    @property
    def span(self) -> int:
        """Slots [0, span) hold every running sequence."""
        return max(self.running) + 1 if self.running else 0

    def admit(self) -> list[tuple[tuple[int, ...], list[Sequence]]]:
        """Give free slots to waiting sequences; returns them grouped by identical prompt (shared prefill)."""
        if not self.waiting or not self.free:
            return []
        if self.running and (not self.refill or len(self.free) < min(self.admit_threshold, len(self.waiting))):
            return []
        groups: dict[tuple, list[Sequence]] = {}  # (prompt, id(media)) -> its sequences
        while self.waiting and self.free:
            seq = self.waiting.popleft()
            seq.slot = heapq.heappop(self.free)
            self.running[seq.slot] = seq
            groups.setdefault((seq.prompt, id(seq.media)), []).append(seq)
        return [(prompt, seqs) for (prompt, _), seqs in groups.items()]

    def finish(self, seq: Sequence) -> None:
        del self.running[seq.slot]
        heapq.heappush(self.free, seq.slot)
        seq.done = True

    def compact(self, target: int) -> list[tuple[int, int]]:
        """Move every running sequence into slots [0, target); returns the (from, to) moves."""
        assert len(self.running) <= target, (len(self.running), target)
        movers = sorted(slot for slot in self.running if slot >= target)
        holes = sorted(slot for slot in self.free if slot < target)[:len(movers)]
        moves = list(zip(movers, holes))
        for src, dst in moves:
            seq = self.running.pop(src)
            seq.slot = dst
            self.running[dst] = seq
        taken = set(holes)
        self.free = [s for s in self.free if s not in taken] + movers
        heapq.heapify(self.free)
        return moves
