"""The critic's loss: clipped value regression (PPO, Schulman et al. 2017; as in OpenAI baselines).

Returns a per-token loss [B, T] (0 beyond the mask) for `aggregation.aggregate`, plus detached
statistics. Pure tensor math.

Legend: B = responses, T = response tokens (right-padded), mask = response_mask [B, T].
"""
from __future__ import annotations

import torch
from torch import Tensor

from phaserl.algo.masked import masked_mean, upcast
from phaserl.errors import ConfigError


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *,
                       clip_range: float) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss: 0.5 * max((V - R)^2, (V_clip - R)^2).

    V_clip = old_V + clip(V - old_V, -clip_range, clip_range) keeps one update from moving the
    value far from the one the advantages were computed with; the max makes it pessimistic.

    Args:
        values: [B, T] current critic values (requires grad).
        old_values: [B, T] critic values at rollout time.
        returns: [B, T] targets (GAE returns).
        mask: [B, T] response mask.
        clip_range: critic.cliprange_value.

    Returns:
        (loss [B, T], stats) with stats 0-dim detached tensors over the real tokens: clipfrac
        (tokens where the clipped error is the larger one), values_mean.
    """
    if clip_range < 0:
        raise ConfigError(f"critic.cliprange_value must be >= 0, got {clip_range}")
    values, old_values, returns = upcast(values), upcast(old_values), upcast(returns)
    clipped_values = old_values + (values - old_values).clamp(-clip_range, clip_range)  # [B, T]
    unclipped_err = (values - returns).square()
    clipped_err = (clipped_values - returns).square()
    loss = 0.5 * torch.maximum(unclipped_err, clipped_err)  # [B, T]
    loss = torch.where(mask.bool(), loss, torch.zeros((), device=loss.device))
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((clipped_err > unclipped_err).float(), mask),
            "values_mean": masked_mean(values, mask),
        }
    return loss, stats
