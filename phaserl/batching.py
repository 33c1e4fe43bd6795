"""Forming micro-batches by token budget, and trimming padding from them.

A micro-batch is a set of rows whose padded size (rows × widest row) stays under a token budget, so
one setting serves short and long responses alike. Rows keep their order; the budget counts the
tokens a forward pass actually sees after `trim_padding`. With `ppo.packing: true` the rows are
instead concatenated without padding (`phaserl.packing`), behind the same interface: index lists
in, index lists out.
"""
from __future__ import annotations

import torch

from .batch import RolloutBatch


def row_spans(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: left padding of the prompt and real response length.  Both [B] long."""
    prompt_mask = batch.attention_mask[:, : batch.prompt_width]    # [B, P]
    left_pad = batch.prompt_width - prompt_mask.sum(dim=1)         # [B]
    return left_pad.long(), batch.response_mask.sum(dim=1).long()  # [B], [B]


def split_by_tokens(batch: RolloutBatch, token_budget: int) -> list[torch.Tensor]:
    """Consecutive row groups whose trimmed padded size fits `token_budget` (one row always fits)."""
    left_pad, resp_len = row_spans(batch)
    groups, start = [], 0
    B = batch.num_responses
    while start < B:
        end = start + 1
        while end < B:
            rows = end + 1 - start
            width = (batch.prompt_width - int(left_pad[start:end + 1].min())) + int(resp_len[start:end + 1].max())
            if rows * width > token_budget:
                break
            end += 1
        groups.append(torch.arange(start, end))
        start = end
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
    )


def pad_response_tensor(t: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad a [b, r] response-aligned tensor with zeros to [b, width]."""
    if t.shape[1] == width:
        return t
    out = t.new_zeros((t.shape[0], width))
    out[:, : t.shape[1]] = t
    return out
