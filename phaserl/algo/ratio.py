"""The importance ratio r = pi / pi_old shared by every policy loss: its bound, its k3 and the clip check.

Pure tensor helpers for `policy_loss` and `policy_loss_families`; the losses themselves live there.

Legend: B = responses, T = response tokens (right-padded), mask = response_mask [B, T].
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from phaserl.algo.masked import masked_mean
from phaserl.errors import ConfigError

# exp() of a log-ratio beyond this overflows and only happens when something is already broken.
LOG_RATIO_BOUND = 20.0


def bounded_ratio(log_ratio: Tensor) -> Tensor:
    """exp(log r) with log r clamped to [-20, 20] (verl's bound).  [B, T] -> [B, T]"""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def approx_kl(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """k3 estimate of KL(old || new) from samples of the old policy: (r - 1) - log r, averaged."""
    log_ratio = log_ratio.detach().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return masked_mean(torch.exp(log_ratio) - 1.0 - log_ratio, mask)


def zero_padding(loss: Tensor, mask: Tensor) -> Tensor:
    """`loss` with 0 beyond the mask (where(), so inf/nan in padding cannot leak)."""
    return torch.where(mask.bool(), loss, torch.zeros((), dtype=loss.dtype, device=loss.device))


def check_clip(clip_low: float, clip_high: float, dual_clip_c: Optional[float], *, low_max: float = 1.0,
               low_inclusive: bool = False) -> None:
    """ConfigErrors for clip ranges that cannot work (a lower bound of 1 - clip_low <= 0, say)."""
    if not (0.0 <= clip_low <= low_max if low_inclusive else 0.0 <= clip_low < low_max):
        interval = f"[0, {low_max:g}]" if low_inclusive else f"[0, {low_max:g})"
        raise ConfigError(f"actor.clip_ratio_low must be in {interval}, got {clip_low}")
    if clip_high < 0.0:
        raise ConfigError(f"actor.clip_ratio_high must be >= 0, got {clip_high}")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ConfigError(f"actor.dual_clip_c must be > 1 (3.0 is usual) or null to turn it off, got {dual_clip_c}")
