"""Packing rows into one sequence without padding, and scattering per-token results back.

`pack_rows(batch, idx)` concatenates the real tokens of rows `idx` into a single row [1, N]; each
row keeps its own position ids (0 at its first real token) and a sequence id, so the decoder's
`seq_ids=` argument can build a block-diagonal causal mask and no token ever sees another row.
`split_packed_by_tokens` groups rows by REAL tokens, so the budget counts no padding at all.
Not here: the forward passes (roles/forward.py), varlen GPU kernels (the CPU path is a dense
block-diagonal mask, correct but quadratic in N).

Legend: B rows of the batch, b rows packed, S = P + R sequence width, R response width (trimmed to the
longest packed response), N real tokens packed, M real response tokens packed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import RolloutBatch


@dataclass
class Packed:
    """Rows `rows` of a RolloutBatch as one padding-free sequence."""

    rows: torch.Tensor           # [b] the batch rows packed, in order
    input_ids: torch.Tensor      # [1, N]
    position_ids: torch.Tensor   # [1, N] each row's own positions
    seq_ids: torch.Tensor        # [1, N] long: k for the tokens of the k-th packed row
    cu_seqlens: torch.Tensor     # [b + 1] int32: row k occupies [cu_seqlens[k], cu_seqlens[k + 1])
    predict_index: torch.Tensor  # [M] packed position whose output predicts each real response token
    target_ids: torch.Tensor     # [M] the response tokens themselves
    response_mask: torch.Tensor  # [b, R] bool, R = longest packed response (at least 1)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def unpack(self, per_token: torch.Tensor) -> torch.Tensor:
        """Per-response-token values [M] (ordered like `predict_index`) -> response-aligned [b, R], zeros elsewhere."""
        out = torch.zeros(self.response_mask.shape, dtype=per_token.dtype, device=per_token.device)  # [b, R]
        return out.masked_scatter(self.response_mask, per_token)


def real_lengths(batch: RolloutBatch) -> torch.Tensor:
    """Real (non-padding) tokens of each row, prompt and response together.  [B] long"""
    return batch.attention_mask.bool().sum(dim=1).long()


def pack_rows(batch: RolloutBatch, idx: torch.Tensor) -> Packed:
    """Concatenate the real tokens of rows `idx` (1-D long) into one sequence; see `Packed`."""
    P = batch.prompt_width
    real = batch.attention_mask[idx].bool()                          # [b, S]
    lengths = real.sum(dim=1)                                         # [b]
    cu = torch.zeros(len(idx) + 1, dtype=torch.long, device=real.device)
    cu[1:] = lengths.cumsum(0)
    # Where each column of each row lands in the packed sequence (meaningful on real columns only).
    packed_pos = cu[:-1, None] + real.long().cumsum(dim=1) - 1        # [b, S]
    resp_mask = batch.response_mask[idx].bool()                       # [b, R_full]
    keep = max(int(resp_mask.sum(dim=1).max()) if len(idx) else 0, 1)
    resp_mask = resp_mask[:, :keep]                                   # [b, R]
    # Column P + t holds response token t; column P + t - 1 (a real token) predicts it.
    predict_index = packed_pos[:, P - 1: P - 1 + keep][resp_mask]    # [M]
    target_ids = batch.input_ids[idx, P: P + keep][resp_mask]         # [M]
    seq_ids = torch.repeat_interleave(torch.arange(len(idx), device=real.device), lengths)  # [N]
    return Packed(
        rows=idx, input_ids=batch.input_ids[idx][real][None], position_ids=batch.position_ids[idx][real][None],
        seq_ids=seq_ids[None], cu_seqlens=cu.to(torch.int32), predict_index=predict_index,
        target_ids=target_ids, response_mask=resp_mask,
    )


def split_packed_by_tokens(batch: RolloutBatch, token_budget: int) -> list[torch.Tensor]:
    """Consecutive row groups whose total real tokens fit `token_budget` (a longer row goes alone).

    Order-preserving and balanced: of all splits into as few groups as the budget allows, the one
    whose largest group is smallest (binary search on the per-group cap), so no micro-batch is a
    small leftover.
    """
    lengths = real_lengths(batch).tolist()
    if not lengths:
        return []
    fewest = len(_greedy(lengths, token_budget))
    lo, hi = min(token_budget, -(-sum(lengths) // fewest)), token_budget  # cap >= ceil(total / groups)
    while lo < hi:  # the group count of greedy filling only falls as the cap grows
        mid = (lo + hi) // 2
        if len(_greedy(lengths, mid)) <= fewest:
            hi = mid
        else:
            lo = mid + 1
    return [torch.arange(start, end) for start, end in _greedy(lengths, lo)]


def _greedy(lengths: list, budget: int) -> list[tuple[int, int]]:
    groups, start, used = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and used + n > budget:
            groups.append((start, i))
            start, used = i, 0
        used += n
    groups.append((start, len(lengths)))
    return groups
