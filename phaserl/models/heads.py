"""Vocabulary heads that are more than a projection: soft-capping, and token log-probs through any head.

`softcap` is Gemma's final-logit soft-capping, `cap * tanh(z / cap)`, as transformers computes it (divide,
tanh, multiply, in the logits' dtype). `chunked_token_logprobs` scores target tokens through a model's own
`logits(hidden)` a chunk at a time (each chunk recomputed in backward), so a [N, V] tensor never exists at
once; the native decoder (soft-capped Gemma 4) and the transformers path (hf_fallback.py) both use it when
their head is not a plain projection, which the roles' fused projection kernels assume.
Not here: the fused projection + log-softmax kernels for plain heads (phaserl/algo/logprobs.py).

Legend: N scored tokens, H hidden, V vocab.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint


def softcap(z: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """cap * tanh(z / cap) (z unchanged when cap is None)."""
    return z if cap is None else torch.tanh(z / cap) * cap


def chunked_token_logprobs(logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                           targets: torch.Tensor, *, temperature: float = 1.0, with_entropy: bool = False,
                           chunk_size: int = 1024) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log softmax(logits(hidden) / temperature)[target]: hidden [N, H], targets [N] -> [N] float32 (and
    entropies [N] float32 when with_entropy)."""
    def chunk(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        z = logits(h).float() / temperature  # [n, V]
        lse = torch.logsumexp(z, dim=-1)
        out = [z.gather(-1, t[:, None]).squeeze(-1) - lse]
        if with_entropy:
            out.append(lse - (z.softmax(-1) * z).sum(-1))
        return torch.stack(out)  # [1 or 2, n]

    parts = []
    for start in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[start:start + chunk_size], targets[start:start + chunk_size].long()
        parts.append(checkpoint(chunk, h, t, use_reentrant=False) if torch.is_grad_enabled() and h.requires_grad
                     else chunk(h, t))
    out = torch.cat(parts, dim=1) if parts else hidden.new_zeros(2 if with_entropy else 1, 0, dtype=torch.float32)
    return out[0], (out[1] if with_entropy else None)
