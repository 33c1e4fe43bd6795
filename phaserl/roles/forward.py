"""Forward passes shared by the roles: response log-probs, entropies and values of a batch.

Every role runs the same model code; this module turns a `RolloutBatch` into response-aligned
tensors [B, R] micro-batch by micro-batch. Only the real response tokens are projected onto the
vocabulary (in chunks, by `algo.token_logprobs_from_hidden`), so padding costs no vocab matmul.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..algo import token_logprobs_from_hidden
from ..batch import RolloutBatch
from ..batching import pad_response_tensor, split_by_tokens, trim_padding


def response_hidden(model, mb: RolloutBatch) -> torch.Tensor:
    """Hidden states that predict each response token.  [b, R, H]"""
    hidden = model(mb.input_ids, position_ids=mb.position_ids, attention_mask=mb.attention_mask)  # [b, S, H]
    P = mb.prompt_width
    return hidden[:, P - 1: -1]  # position t predicts token t + 1


def micro_logprobs(model, mb: RolloutBatch, *, temperature: float, with_entropy: bool,
                   chunk_size: int = 1024) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (and entropies) of the response tokens of one trimmed micro-batch.  [b, R] each."""
    h = response_hidden(model, mb)                      # [b, R, H]
    mask = mb.response_mask.bool()                       # [b, R]
    targets = mb.response_ids[mask]                      # [N]
    logp, ent = token_logprobs_from_hidden(
        h[mask], model.output_weight, targets, temperature=temperature,
        chunk_size=chunk_size, with_entropy=with_entropy)  # [N], [N]
    logprobs = torch.zeros(mask.shape, dtype=torch.float32, device=h.device)
    logprobs = logprobs.masked_scatter(mask, logp.float())  # [b, R]
    entropy = None
    if with_entropy:
        entropy = torch.zeros_like(logprobs).masked_scatter(mask, ent.float())
    return logprobs, entropy


@torch.no_grad()
def batch_logprobs(model, batch: RolloutBatch, *, temperature: float, token_budget: int) -> torch.Tensor:
    """Forward-only log-probs of every response token of `batch`.  [B, R] float32"""
    R = batch.response_mask.shape[1]
    out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=batch.input_ids.device)
    for idx in split_by_tokens(batch, token_budget):
        mb = trim_padding(batch.select(idx))
        logp, _ = micro_logprobs(model, mb, temperature=temperature, with_entropy=False)
        out[idx] = pad_response_tensor(logp, R)
    return out


def micro_values(value_model, mb: RolloutBatch) -> torch.Tensor:
    """Critic values at the positions that predict each response token.  [b, R] float32"""
    values = value_model(mb.input_ids, position_ids=mb.position_ids, attention_mask=mb.attention_mask)  # [b, S]
    P = mb.prompt_width
    return values[:, P - 1: -1].float() * mb.response_mask


@torch.no_grad()
def batch_values(value_model, batch: RolloutBatch, *, token_budget: int) -> torch.Tensor:
    """Forward-only values for every response token of `batch`.  [B, R] float32"""
    R = batch.response_mask.shape[1]
    out = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=batch.input_ids.device)
    for idx in split_by_tokens(batch, token_budget):
        out[idx] = pad_response_tensor(micro_values(value_model, trim_padding(batch.select(idx))), R)
    return out
