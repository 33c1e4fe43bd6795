"""StaticExtend: the multi-turn continuation (extend) pass with static shapes, one CUDA graph per bucket.

`ModelRunner._extend_pass` (runner.py) gives every pass its exact shape (C rows, M tokens, the context cut at
the longest row), so each pass launches its ~50 kernels per layer from Python: on the H200 at 0.5B (24 layers)
an extend pass took 38-43 ms, as long on the host as on the device. StaticExtend runs the same math
(`ModelRunner._extend_forward`) on fixed shapes, so that each (rows R, tokens T) bucket is captured once as a
CUDA graph (lazily, at the bucket's second pass (CAPTURE_AT), into the decode graphs' memory pool, through
`ModelRunner._capture`) and replayed after (one graph per rows bucket R, tokens bucket T, context bucket K and
sampling settings):
  inputs   one host tensor per pass (ids [R, T], starts, lengths, slots, caps, source [R] each) copied into the
           bucket's device buffer; positions and RoPE rows (and masks, on the torch path) are computed from it on
           the device
  context  the keys [0, K) of each row's slot, masked per row, K the context bucket of the longest row's end
           (at most S): the same softmax as the exact context, over more keys (extend_kernel.py's attention reads
           only the keys each program's tokens see, so K costs it nothing)
  padding  tokens: ids 0 past a row's length, writing KV (and MoE routes) past the row's end, where decode
           writes before it reads (as the eager pass's padding does); they attend without a window, so that
           none sees no key at all (NaN). Rows: the first row's slot at position S - 1, length 0 (all its tokens
           are padding), which is past that row's end too; its slot state takes the first row's sampled token,
           end and cap (`source`), so the duplicate writes of SlotState.start are identical
Graphs go with the decode ones (runner.graphs): when the layout or the weights' addresses change. Without CUDA
graphs (the CPU) the same static pass runs eagerly, which is what the CPU tests check against `_extend_pass`.
Qwen3.5's HybridRunner runs its own `_extend_forward` here too: a linear layer's padding row (length 0) would write
its slot's old recurrent state back, so every row's slot takes the new state of its `source` row (identical
duplicate writes, as for SlotState.start).
Not here: which sequence is in which slot (session.py).

Legend: R rows bucket, T tokens bucket, K context bucket, S slot_len.
"""
from __future__ import annotations

import array

import torch

from phaserl.rollout.runner import ModelRunner

STEP = 8  # the smallest tokens bucket
# A bucket's graph is captured at its CAPTURE_AT-th pass; the passes before run the same static pass eagerly. On
# the H200 (2026-12-01, capturing at first sight) new buckets kept being captured inside short timed runs, at a
# cost the replays did not win back; capturing at the second sight spends captures only on buckets that recur.
CAPTURE_AT = 2


def ladder(n: int, limit: int) -> int:
    """The bucket for n, at most `limit`: n itself up to 2, then the next power of two. Powers of two, not a finer
    ladder: on the H200 (2026-12-01, agent_rollout.py at 0.5B, 6 repeats, multiples of 8 up to 64 and 1.5x steps
    above) the (rows, tokens, context) buckets of lockstep episodes kept being new in every repeat (captures
    [0, 0, 3, 1, 1, 2]), because how many rows one pass takes depends on when the answers arrive; an eager pass
    was 36-44 ms of launches and a replay 3-4 ms, so a pass padded up to twice its rows costs far less than a
    capture or an eager pass, and fewer buckets recur sooner."""
    bucket = n if n <= 2 else 1 << (n - 1).bit_length()  # n <= bucket < 2n
    return min(bucket, limit)


def tokens_bucket(n: int, slot_len: int) -> int:
    """Tokens per row of the pass that holds rows of up to `n` ids (at least STEP, at most the slot)."""
    return ladder(max(n, STEP), slot_len)


def context_bucket(end: int, slot_len: int) -> int:
    """Key positions the pass attends when its rows end at most at `end`: at least 64, at most the slot. The
    whole slot for every pass would cost attention over all S keys (the slot's length, not the context's)."""
    return ladder(max(end, 64), slot_len)


def rows_bucket(rows: int, num_slots: int) -> int:
    """Rows of the pass that holds `rows` items (at least 2: compiled functions specialize on size 1)."""
    return ladder(max(rows, 2), max(num_slots, 2))


class StaticExtend:
    """The static extend passes of one ModelRunner: device input buffers per bucket, graphs in runner.graphs."""

    def __init__(self, runner: ModelRunner):
        if type(runner)._extend_pass is not ModelRunner._extend_pass:
            raise ValueError(f"{type(runner).__name__} has its own extend pass; StaticExtend runs its _extend_forward")
        self.runner = runner
        self.buffers: dict = {}  # (R, T) -> long [R * T + 5 * R] on the device: what that bucket's graph reads
        self.passes = 0
        self.seen: dict = {}  # graph key -> passes run with it so far (a key is captured from its second pass on)

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
        K = context_bucket(max(start + len(t) for _, t, start, _ in items), S)
        buffer = self.buffers.get((R, T))
        if buffer is None:
            buffer = self.buffers[(R, T)] = torch.empty(R * T + 5 * R, dtype=torch.long, device=r.device)
        buffer.copy_(self.pack(items, R, T, S), non_blocking=True)
        self.passes += 1
        key = ("extend", R, T, K, r.sampling)
        graph = r.graphs.get(key) if r.use_graphs else None
        seen = self.seen.get(key, 0)
        self.seen[key] = seen + 1
        if graph is not None:
            graph.replay()
        elif r.use_graphs and seen >= CAPTURE_AT - 1:
            r._capture(key, lambda: self.forward(buffer, R, T, K))
        else:
            self.forward(buffer, R, T, K)

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
        lengths = [len(tokens) for _, tokens, _, _ in items] + [0] * pad  # no real token: no window (runner.py)
        slots = [slot for slot, _, _, _ in items] + [slot0] * pad
        caps = [cap for _, _, _, cap in items] + [cap0] * pad
        source = list(range(len(items))) + [0] * pad
        # through an int64 array: 0.29 ms for 256 rows x 40 tokens on the CPU, torch.tensor(list) 1.1 ms
        return torch.frombuffer(array.array("q", ids + starts + lengths + slots + caps + source), dtype=torch.long)

    def forward(self, buffer: torch.Tensor, R: int, T: int, K: int) -> None:
        """The pass of bucket (R, T, K) over what `buffer` holds: no host sync, fixed shapes (capturable)."""
        ids = buffer[:R * T].view(R, T)
        starts, lengths, slots, caps, source = buffer[R * T:].view(5, R)
        self.runner._extend_forward(ids, starts, lengths, slots, caps, K, source)
