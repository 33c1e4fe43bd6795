"""StaticExtend: the multi-turn continuation (extend) pass with static shapes, one CUDA graph per bucket.

`ModelRunner._extend_pass` (runner.py) gives every pass its exact shape (C rows, M tokens, the context cut at
the longest row), so each pass launches its ~50 kernels per layer from Python: on the H200 at 0.5B (24 layers)
an extend pass took 38-43 ms, as long on the host as on the device. StaticExtend runs the same math
(`ModelRunner._extend_forward`) on fixed shapes, so that each (rows R, tokens T) bucket is captured once as a
CUDA graph (lazily, into the decode graphs' memory pool, through `ModelRunner._capture`) and replayed after:
  inputs   one host tensor per pass (ids [R, T], starts, lengths, slots, caps, source [R] each) copied into the
           bucket's device buffer; positions, masks and RoPE rows are computed from it on the device
  context  the whole slot (S keys), masked per row: the same softmax as the exact context, over more keys
  padding  tokens: ids 0 past a row's length, writing KV (and MoE routes) past the row's end, where decode
           writes before it reads (as the eager pass's padding does). Rows: a copy of the first row's slot at
           position S - 1 (one token), which is past that row's end too; its slot state takes the first row's
           sampled token, end and cap (`source`), so the duplicate writes of SlotState.start are identical
Graphs go with the decode ones (runner.graphs): when the layout or the weights' addresses change. Without CUDA
graphs (the CPU) the same static pass runs eagerly, which is what the CPU tests check against `_extend_pass`.
Not here: Qwen3.5's HybridRunner (its recurrent state has no position past the end where a padding row's writes
are harmless: it keeps its eager pass), which sequence is in which slot (session.py).

Legend: R rows bucket, T tokens bucket, S slot_len.
"""
from __future__ import annotations

import torch

from phaserl.rollout.runner import ModelRunner, decode_buckets

MIN_TOKENS = 8  # the smallest tokens bucket


def tokens_bucket(n: int, slot_len: int) -> int:
    """Tokens per row of the pass that holds rows of up to `n` ids: a power of two >= MIN_TOKENS, at most S."""
    return min(slot_len, max(MIN_TOKENS, 1 << (n - 1).bit_length()))


def rows_bucket(rows: int, num_slots: int) -> int:
    """Rows of the pass that holds `rows` items: the decode buckets (runner.decode_buckets) serve here too."""
    return next(b for b in decode_buckets(num_slots) if b >= rows)


class StaticExtend:
    """The static extend passes of one ModelRunner: device input buffers per bucket, graphs in runner.graphs."""

    def __init__(self, runner: ModelRunner):
        if type(runner)._extend_pass is not ModelRunner._extend_pass:
            raise ValueError(f"{type(runner).__name__} has its own extend pass; StaticExtend runs ModelRunner's")
        self.runner = runner
        self.buffers: dict = {}  # (R, T) -> long [R * T + 5 * R] on the device: what that bucket's graph reads
        self.passes = 0

    def extend(self, items: list[tuple[int, list[int], int, int]]) -> None:
        """items: (slot, tokens, start, cap), as ModelRunner.extend; split into passes whose padded size
        (rows bucket x tokens bucket) stays within prefill_tokens (a single longer item gets a pass of its own)."""
        (num_slots, S, _), budget = self.runner.layout, self.runner.prefill_tokens
        chunk, longest = [], 0
        for item in items:
            n = max(longest, len(item[1]))
            if chunk and rows_bucket(len(chunk) + 1, num_slots) * tokens_bucket(n, S) > budget:
                self.run(chunk)
                chunk, n = [], len(item[1])
            chunk.append(item)
            longest = n
        if chunk:
            self.run(chunk)

    def run(self, items) -> None:
        """One pass over `items` (their padded size is the caller's choice): replay its bucket's graph, capture it
        (the capture's eager run is this pass), or run eagerly without graphs."""
        r = self.runner
        (num_slots, S, _) = r.layout
        R, T = rows_bucket(len(items), num_slots), tokens_bucket(max(len(t) for _, t, _, _ in items), S)
        buffer = self.buffers.get((R, T))
        if buffer is None:
            buffer = self.buffers[(R, T)] = torch.empty(R * T + 5 * R, dtype=torch.long, device=r.device)
        buffer.copy_(self.pack(items, R, T, S), non_blocking=True)
        self.passes += 1
        key = ("extend", R, T, r.sampling)
        graph = r.graphs.get(key) if r.use_graphs else None
        if graph is not None:
            graph.replay()
        elif r.use_graphs:
            r._capture(key, lambda: self.forward(buffer, R, T))
        else:
            self.forward(buffer, R, T)

    @staticmethod
    def pack(items, R: int, T: int, S: int) -> torch.Tensor:
        """The pass's inputs as one host tensor [R * T + 5 * R]: ids [R, T] (0 past each row's length), then
        starts, lengths, slots, caps and source [R] each; rows past len(items) are padding rows (see the module)."""
        ids: list[int] = []
        for _, tokens, _, _ in items:
            ids += tokens
            ids += [0] * (T - len(tokens))
        pad = R - len(items)
        ids += [0] * (pad * T)
        assert all(start + len(tokens) < S for _, tokens, start, _ in items), "a turn needs a position after its ids"
        slot0, cap0 = items[0][0], items[0][3]
        starts = [start for _, _, start, _ in items] + [S - 1] * pad
        lengths = [len(tokens) for _, tokens, _, _ in items] + [1] * pad
        slots = [slot for slot, _, _, _ in items] + [slot0] * pad
        caps = [cap for _, _, _, cap in items] + [cap0] * pad
        source = list(range(len(items))) + [0] * pad
        return torch.tensor(ids + starts + lengths + slots + caps + source, dtype=torch.long)

    def forward(self, buffer: torch.Tensor, R: int, T: int) -> None:
        """The pass of bucket (R, T) over what `buffer` holds: no host sync, fixed shapes (capturable)."""
        ids = buffer[:R * T].view(R, T)
        starts, lengths, slots, caps, source = buffer[R * T:].view(5, R)
        self.runner._extend_forward(ids, starts, lengths, slots, caps, self.runner.layout[1], source)
