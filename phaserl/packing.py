"""Packing rows into one sequence without padding, and scattering per-token results back.

`pack_rows(batch, idx)` concatenates the real tokens of rows `idx` into a single row [1, N]; each
row keeps its own position ids (0 at its first real token) and a sequence id, so the decoder's
`seq_ids=` argument can build a block-diagonal causal mask and no token ever sees another row.
`split_packed_by_tokens` groups rows by REAL tokens, so the budget counts no padding at all, and
deals them out so that the groups carry about the same number of tokens.
Not here: the forward passes (roles/forward.py), the attention kernels (models/decoder.py: varlen
flash on CUDA, a dense block-diagonal mask elsewhere).

Legend: B rows of the batch, b rows packed, S = P + R sequence width, R response width (trimmed to the
longest packed response), N real tokens packed, M real response tokens packed.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional

import torch

from .batch import RolloutBatch, send
from .models.decoder import PackedSeqs


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
    max_len: int = 0             # longest packed row (the varlen kernel's max_seqlen)
    response_index: Optional[torch.Tensor] = None  # [M] flat positions of the real tokens of response_mask
    routed_experts: Optional[torch.Tensor] = None  # [1, N, L, k] the rollout's experts (routing replay), or None
    images: Optional[list] = None  # [b] each packed row's data.images.ImageInputs (vision-language rows), or None

    @property
    def boundaries(self) -> PackedSeqs:
        """The varlen kernel's view of the rows, known on the host (the decoder skips recomputing it)."""
        return PackedSeqs(cu_seqlens=self.cu_seqlens, max_len=self.max_len)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def unpack(self, per_token: torch.Tensor) -> torch.Tensor:
        """Per-response-token values [M] (ordered like `predict_index`) -> response-aligned [b, R], zeros elsewhere.

        An index copy to positions planned on the host: its backward is an index select, where
        masked_scatter's (a masked_select) would wait for the device to count the mask."""
        b, R = self.response_mask.shape
        if self.response_index is None:  # built by hand, not by pack_rows
            self.response_index = self.response_mask.reshape(-1).nonzero().squeeze(1)
        out = torch.zeros(b * R, dtype=per_token.dtype, device=per_token.device)
        return out.index_copy(0, self.response_index, per_token).view(b, R)  # [b, R]


def real_lengths(batch: RolloutBatch) -> torch.Tensor:
    """Real (non-padding) tokens of each row, prompt and response together.  [B] long"""
    return batch.on_host("attention_mask").bool().sum(dim=1).long()


def pack_rows(batch: RolloutBatch, idx: torch.Tensor) -> Packed:
    """Concatenate the real tokens of rows `idx` (1-D long) into one sequence; see `Packed`.

    The layout is computed on the host from the batch's CPU masks (RolloutBatch.on_host) and sent to
    the device without waiting: no device sync per micro-batch, so the GPU never idles while the
    host plans the next one.
    """
    P = batch.prompt_width
    idx = idx.cpu()
    real = batch.on_host("attention_mask")[idx].bool()              # [b, S]
    S = real.shape[1]
    lengths = real.sum(dim=1)                                         # [b]
    cu = torch.zeros(len(idx) + 1, dtype=torch.long)
    cu[1:] = lengths.cumsum(0)
    # Where each column of each row lands in the packed sequence (meaningful on real columns only).
    packed_pos = cu[:-1, None] + real.long().cumsum(dim=1) - 1        # [b, S]
    resp_mask = batch.on_host("response_mask")[idx].bool()          # [b, R_full]
    keep = max(int(resp_mask.sum(dim=1).max()) if len(idx) else 0, 1)
    resp_mask = resp_mask[:, :keep]                                   # [b, R]
    # Column P + t holds response token t; column P + t - 1 (a real token) predicts it.
    predict_index = packed_pos[:, P - 1: P - 1 + keep][resp_mask]    # [M]
    flat_rows = (idx[:, None] * S + torch.arange(S)[None])            # [b, S] positions in the flat batch
    source = flat_rows[real]                                          # [N] the packed tokens' flat positions
    target_source = flat_rows[:, P: P + keep][resp_mask]              # [M] the response tokens' flat positions
    seq_ids = torch.repeat_interleave(torch.arange(len(idx)), lengths)  # [N]
    device = batch.input_ids.device
    to_device = lambda t: send(t, device)  # noqa: E731
    source, target_source = to_device(source), to_device(target_source)
    return Packed(
        rows=idx, input_ids=batch.input_ids.reshape(-1)[source][None],
        position_ids=batch.position_ids.reshape(-1)[source][None],
        seq_ids=to_device(seq_ids)[None], cu_seqlens=to_device(cu.to(torch.int32)),
        predict_index=to_device(predict_index), target_ids=batch.input_ids.reshape(-1)[target_source],
        response_mask=to_device(resp_mask), max_len=int(lengths.max()) if len(idx) else 0,
        response_index=to_device(resp_mask.reshape(-1).nonzero().squeeze(1)),
        routed_experts=None if batch.routed_experts is None else batch.routed_experts.flatten(0, 1)[source][None],
        images=None if batch.images is None else [batch.images[i] for i in idx.tolist()],
    )


def split_packed_by_tokens(batch: RolloutBatch, token_budget: int,
                           num_groups: Optional[int] = None) -> list[torch.Tensor]:
    """Row groups whose total real tokens fit `token_budget` (a longer row goes alone), balanced.

    Longest-first dealing: rows, longest first, each join the group with the fewest tokens so far;
    the group count is the fewest for which that fits the budget, or `num_groups` when given (every
    rank then runs the same number of micro-batches; roles/forward.py agrees on it). Each group lists
    its rows in batch order; groups are ordered by their first row.
    """
    lengths = real_lengths(batch).tolist()
    if not lengths:
        return []
    if num_groups is None:
        cap = max(token_budget, max(lengths))
        num_groups = min(max(1, -(-sum(lengths) // token_budget)), len(lengths))
        while num_groups < len(lengths) and max(sum(lengths[i] for i in g)
                                                for g in _deal(lengths, num_groups)) > cap:
            num_groups += 1
    if num_groups > len(lengths):
        raise ValueError(f"cannot split {len(lengths)} rows into {num_groups} non-empty micro-batches")
    return [torch.tensor(g, dtype=torch.long) for g in sorted(sorted(g) for g in _deal(lengths, num_groups))]


def _deal(lengths: list, num_groups: int) -> list[list]:
    """Longest-processing-time dealing: each row (longest first) to the lightest group (lowest index on ties)."""
    heap = [(0, k) for k in range(num_groups)]
    groups: list[list] = [[] for _ in range(num_groups)]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        load, k = heapq.heappop(heap)
        groups[k].append(i)
        heapq.heappush(heap, (load + lengths[i], k))
    return groups
