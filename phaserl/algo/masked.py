"""Statistics over the real tokens of a right-padded batch.

Every function here reads `x` only where `mask` is 1, so padding may hold anything (garbage logits,
stale values) without changing the result. Pure tensor math: no I/O, no distributed reductions —
a statistic over several ranks is the caller's business.

Legend: B = responses, T = response tokens (right-padded), mask = response_mask [B, T] (1 = real).
The functions accept any shape as long as `x` and `mask` broadcast together.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor


def upcast(x: Tensor) -> Tensor:
    """`x` in the dtype the RL math runs in: at least float32 (bf16/fp16 -> fp32, fp64 stays)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Sum of `x` over the positions where `mask` is 1.

    Args:
        x: values, e.g. [B, T].
        mask: 1 for real entries, 0 for padding, same shape as `x`.
        dim: reduce this dim only (e.g. -1 gives one sum per response, [B]); None reduces everything.

    Returns:
        A scalar when `dim` is None, else `x` with `dim` removed.
    """
    # where() instead of x * mask: padding that holds inf or nan must not leak through 0 * inf = nan.
    picked = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return picked.sum() if dim is None else picked.sum(dim)


def _count(mask: Tensor, dim: Optional[int], dtype: torch.dtype) -> Tensor:
    return mask.to(dtype).sum() if dim is None else mask.to(dtype).sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of `x` over the positions where `mask` is 1.

    A reduction with no real entry (an empty response, say) gives 0 rather than nan, so one empty
    row cannot poison a logged statistic; losses that must not see empty rows are averaged by
    `aggregation.aggregate`, which divides by global counts instead.

    Shapes: as `masked_sum`.
    """
    count = _count(mask, dim, x.dtype)  # scalar, or [B] for dim=-1 on [B, T]
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, dim: Optional[int] = None, unbiased: bool = True) -> Tensor:
    """Variance of `x` over the positions where `mask` is 1.

    Args:
        unbiased: divide by (n - 1) (Bessel's correction, torch.var's default, used by verl's
            `masked_whiten`) instead of n. With n = 1 the squared deviation is 0, so the variance
            is 0 rather than the nan of 0 / 0.

    Shapes: as `masked_sum`.
    """
    mean = masked_mean(x, mask, dim)
    centered = x - (mean if dim is None else mean.unsqueeze(dim))
    count = _count(mask, dim, x.dtype)
    denom = (count - 1).clamp(min=1) if unbiased else count.clamp(min=1)
    return masked_sum(centered * centered, mask, dim) / denom


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8, *,
                  total: Optional[Callable[[Tensor], Tensor]] = None) -> Tensor:
    """Normalise `x` to zero mean and unit variance over all of its real entries.

    The statistics are taken over every real entry of the batch at once (the "whiten over the
    batch" of PPO's advantage normalisation, REINFORCE++ and verl's `masked_whiten`), with the
    unbiased variance.

    Args:
        x: values, e.g. advantages [B, T].
        mask: 1 for real entries, same shape as `x`.
        shift_mean: False keeps the original mean (only the scale changes).
        eps: added to the variance before the square root.
        total: sums a statistic over every part of the batch (under torchrun, the caller passes
            `parallel.all_reduce_sum`, so each rank whitens with the global mean and variance);
            None: `x` is the whole batch.

    Returns:
        The whitened tensor, same shape as `x`, with 0 at every padded position.
    """
    total = total or (lambda t: t)
    count = total(_count(mask, None, x.dtype))
    mean = total(masked_sum(x, mask)) / count.clamp(min=1)
    centered = x - mean
    var = total(masked_sum(centered * centered, mask)) / (count - 1).clamp(min=1)  # unbiased
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros((), dtype=whitened.dtype, device=x.device))
