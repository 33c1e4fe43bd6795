"""Phase 2 (rollout) helpers: prompts → generation requests → a padded `RolloutBatch`.

The n responses of a prompt are consecutive rows and share a group id, so group baselines (GRPO,
RLOO) are exact and stay on one rank.
"""
from __future__ import annotations

import torch

from ..batch import RolloutBatch
from ..rollout import GenerationResult


def repeat_prompts(items: list, n: int) -> list:
    """Each prompt item n times in a row."""
    return [item for item in items for _ in range(n)]


def build_rollout_batch(items: list, n: int, result: GenerationResult, *, tokenizer, pad_token_id: int,
                        group_offset: int, device) -> RolloutBatch:
    """Pack prompt items (each repeated n times) and their generated responses into one batch."""
    rows = repeat_prompts(items, n)
    B = len(rows)
    assert len(result.response_ids) == B, (len(result.response_ids), B)
    P = max(len(item.prompt_ids) for item in rows)
    R = max(1, max(len(r) for r in result.response_ids))
    input_ids = torch.full((B, P + R), pad_token_id, dtype=torch.long)      # [B, S]
    attention_mask = torch.zeros((B, P + R), dtype=torch.long)              # [B, S]
    logprobs = torch.zeros((B, R), dtype=torch.float32)                     # [B, R]
    for i, (item, resp, lp) in enumerate(zip(rows, result.response_ids, result.logprobs)):
        p = len(item.prompt_ids)
        input_ids[i, P - p:P] = torch.tensor(item.prompt_ids, dtype=torch.long)
        input_ids[i, P:P + len(resp)] = torch.tensor(resp, dtype=torch.long)
        attention_mask[i, P - p:P + len(resp)] = 1
        logprobs[i, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)         # [B, S]
    group_ids = torch.arange(len(items)).repeat_interleave(n) + group_offset  # [B]
    texts = tokenizer.batch_decode(result.response_ids, skip_special_tokens=True)
    return RolloutBatch(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
        position_ids=position_ids.to(device), response_mask=attention_mask[:, P:].to(device),
        prompt_width=P, group_ids=group_ids.to(device), rollout_logprobs=logprobs.to(device),
        prompts=[item.row.prompt for item in rows], response_texts=texts,
        rows=[item.row for item in rows], finish_reasons=list(result.finish_reasons),
    )
