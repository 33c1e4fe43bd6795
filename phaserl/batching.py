"""Forming micro-batches by token budget, and trimming padding from them.

A micro-batch is a set of rows whose padded size (rows × widest row) stays under a token budget, so
one setting serves short and long responses alike. Rows of similar length go together (less
padding); the budget counts the tokens a forward pass actually sees after `trim_padding`. With
`ppo.packing: true` the rows are instead concatenated without padding (`phaserl.packing`), behind
the same interface: index lists in, index lists out.
"""
from __future__ import annotations

from typing import Optional

import torch

from .batch import RolloutBatch


def row_spans(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: left padding of the prompt and real response length.  Both [B] long."""
    prompt_mask = batch.attention_mask[:, : batch.prompt_width]    # [B, P]
    left_pad = batch.prompt_width - prompt_mask.sum(dim=1)         # [B]
    return left_pad.long(), batch.response_mask.sum(dim=1).long()  # [B], [B]


def split_by_tokens(batch: RolloutBatch, token_budget: int, num_groups: Optional[int] = None) -> list[torch.Tensor]:
    """Row groups of similar length whose trimmed padded size fits `token_budget` (one row always fits).

    Rows are ordered by real length (longest first) and cut into consecutive runs, so a group's rows
    need little padding. With `num_groups` (at least the count the budget needs) exactly that many
    groups are made, the largest as small as possible: every rank then runs the same number of
    micro-batches (roles/forward.py agrees on it). Groups list rows in batch order, ordered by first row.
    """
    left_pad, resp_len = row_spans(batch)
    P = batch.prompt_width
    prompt_len = (P - left_pad).tolist()
    resp = resp_len.tolist()
    order = sorted(range(batch.num_responses), key=lambda i: -(prompt_len[i] + resp[i]))

    def cost(rows: list) -> int:  # tokens of the trimmed, padded micro-batch
        return len(rows) * (max(prompt_len[i] for i in rows) + max(max(resp[i] for i in rows), 1))

    groups = _consecutive(order, cost, token_budget)
    if num_groups is not None and num_groups != len(groups):
        groups = _exactly(order, cost, num_groups, token_budget)
    return [torch.tensor(g, dtype=torch.long) for g in sorted(sorted(g) for g in groups)]


def _consecutive(order: list, cost, cap: int) -> list[list]:
    """Greedy runs of `order` whose cost stays within `cap` (a run always takes at least one row)."""
    groups, current = [], []
    for i in order:
        if current and cost(current + [i]) > cap:
            groups.append(current)
            current = []
        current.append(i)
    return groups + ([current] if current else [])


def _exactly(order: list, cost, num_groups: int, budget: int) -> list[list]:
    """`num_groups` consecutive runs: the smallest cap that needs no more runs, then split the costliest."""
    if num_groups > len(order):
        raise ValueError(f"cannot split {len(order)} rows into {num_groups} non-empty micro-batches")
    lo, hi = 1, max(budget, cost(order[:1]))
    while lo < hi:  # the run count of greedy filling only falls as the cap grows
        mid = (lo + hi) // 2
        if len(_consecutive(order, cost, mid)) <= num_groups:
            hi = mid
        else:
            lo = mid + 1
    groups = _consecutive(order, cost, lo)
    while len(groups) < num_groups:
        k = max((g for g in range(len(groups)) if len(groups[g]) > 1), key=lambda g: cost(groups[g]))
        half = len(groups[k]) // 2
        groups[k:k + 1] = [groups[k][:half], groups[k][half:]]
    return groups


def trim_padding(batch: RolloutBatch) -> RolloutBatch:
    """Drop prompt columns that are padding in every row and response columns past the longest response."""
    left_pad, resp_len = row_spans(batch)
    cut_left = int(left_pad.min())
    keep_resp = max(int(resp_len.max()), 1)
    P = batch.prompt_width
    cols = slice(cut_left, P + keep_resp)
    return RolloutBatch(
        input_ids=batch.input_ids[:, cols], attention_mask=batch.attention_mask[:, cols],
        position_ids=batch.position_ids[:, cols], response_mask=batch.response_mask[:, :keep_resp],
        prompt_width=P - cut_left, group_ids=batch.group_ids,
        rollout_logprobs=batch.rollout_logprobs[:, :keep_resp], prompts=batch.prompts,
        response_texts=batch.response_texts, rows=batch.rows, finish_reasons=batch.finish_reasons,
        loss_mask=batch.loss_mask[:, :keep_resp], episodes=batch.episodes,
        routed_experts=None if batch.routed_experts is None else batch.routed_experts[:, cols],
        images=batch.images,
    )


def pad_response_tensor(t: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad a [b, r] response-aligned tensor with zeros to [b, width]."""
    if t.shape[1] == width:
        return t
    out = t.new_zeros((t.shape[0], width))
    out[:, : t.shape[1]] = t
    return out
