"""Policy-gradient losses: PPO's clipped surrogate (token ratio) and GSPO (sequence ratio).

Both return a per-token loss [B, T] (0 beyond the mask) that the caller turns into one number with
`aggregation.aggregate`, plus detached statistics over the real tokens of this batch. The entropy
bonus and the KL-in-loss term are separate per-token terms the caller adds before aggregating.
The trainer picks one from `POLICY_LOSSES` when the run is built; all share one signature:

    fn(logprobs, old_logprobs, advantages, mask, *, clip_low, clip_high, dual_clip_c) -> (loss, stats)

Legend: B = responses, T = response tokens (right-padded), mask = response_mask [B, T].
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from phaserl.algo.masked import masked_mean, upcast
from phaserl.errors import ConfigError

# exp() of a log-ratio beyond this overflows and only happens when something is already broken.
_LOG_RATIO_BOUND = 20.0


def _check_clip(clip_low: float, clip_high: float, dual_clip_c: Optional[float]) -> None:
    if not 0.0 <= clip_low < 1.0:
        raise ConfigError(f"actor.clip_ratio_low must be in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise ConfigError(f"actor.clip_ratio_high must be >= 0, got {clip_high}")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ConfigError(f"actor.dual_clip_c must be > 1 (3.0 is usual) or null to turn it off, got {dual_clip_c}")


def _clipped_surrogate(log_ratio: Tensor, advantages: Tensor, mask: Tensor, clip_low: float,
                       clip_high: float, dual_clip_c: Optional[float]) -> tuple[Tensor, dict[str, Tensor]]:
    """max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), then min(., -A c) where A < 0."""
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))  # [B, T]
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)  # [B, T]
    dual_clipped = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip_c is not None:
        # Dual-clip (Ye et al. 2020): with A < 0 a huge ratio would make the loss unbounded; cap it at -A c.
        cap = -advantages * dual_clip_c
        dual_clipped = (advantages < 0) & (loss > cap)
        loss = torch.where(dual_clipped, cap, loss)
    loss = torch.where(mask.bool(), loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    with torch.no_grad():
        real = mask.bool()
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).float(), mask),
            "clipfrac_dual": masked_mean(dual_clipped.float(), mask),
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_max": ratio.masked_fill(~real, float("-inf")).max(),  # -inf with no real token
        }
    return loss, stats


def _approx_kl(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """k3 estimate of KL(old || new) from samples of the old policy: (r - 1) - log r, averaged."""
    log_ratio = log_ratio.detach().clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    return masked_mean(torch.exp(log_ratio) - 1.0 - log_ratio, mask)


def ppo_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                    clip_low: float, clip_high: float,
                    dual_clip_c: Optional[float]) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017) with clip-higher and dual-clip.

    Per token, with r = exp(logprobs - old_logprobs):
        loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
    `clip_high > clip_low` is DAPO's clip-higher (Yu et al. 2025). With `dual_clip_c` = c (Ye et al.
    2020, "Mastering Complex Control in MOBA Games") tokens with A < 0 get min(loss, -A c), which
    bounds the loss when r explodes; None turns it off.

    Args:
        logprobs: [B, T] current policy log-probs of the sampled tokens (requires grad).
        old_logprobs: [B, T] log-probs of the policy that sampled them (no grad).
        advantages: [B, T].
        mask: [B, T] response mask.

    Returns:
        (loss [B, T], stats): stats are 0-dim detached tensors over the real tokens: clipfrac
        (tokens where the clip is active), clipfrac_dual, approx_kl (k3 of KL(old || new)),
        ratio_mean, ratio_max.
    """
    _check_clip(clip_low, clip_high, dual_clip_c)
    log_ratio = upcast(logprobs) - upcast(old_logprobs)  # [B, T]
    loss, stats = _clipped_surrogate(log_ratio, upcast(advantages), mask, clip_low, clip_high, dual_clip_c)
    stats["approx_kl"] = _approx_kl(log_ratio, mask)
    return loss, stats


def gspo_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                     clip_low: float, clip_high: float,
                     dual_clip_c: Optional[float]) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), token form (GSPO-token).

    The importance ratio is the length-normalised sequence ratio s_i = exp(mean_t log r_{i,t}),
    and every token of response i uses
        log s_{i,t} = sg[log s_i] + logprobs_{i,t} - sg[logprobs_{i,t}]
    (sg = stop-gradient): its value is s_i and its gradient is s_i * grad logprobs_{i,t}, so with a
    per-sequence advantage and "seq-mean-token-mean" aggregation the gradient is exactly GSPO's
    sequence-level one; per-token advantages give GSPO-token. Clipping (and dual-clip, if set)
    then acts on whole sequences. The paper's clip ranges are small (about 3e-4 / 4e-4).

    Shapes, returns and stats as `ppo_policy_loss`; ratio_* describe s_i, approx_kl the tokens.
    """
    _check_clip(clip_low, clip_high, dual_clip_c)
    logprobs = upcast(logprobs)
    token_log_ratio = logprobs - upcast(old_logprobs)  # [B, T]
    seq_log_ratio = masked_mean(token_log_ratio, mask, dim=-1)  # [B] log s_i
    log_ratio = seq_log_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach()  # [B, T], value log s_i
    loss, stats = _clipped_surrogate(log_ratio, upcast(advantages), mask, clip_low, clip_high, dual_clip_c)
    stats["approx_kl"] = _approx_kl(token_log_ratio, mask)
    return loss, stats


PolicyLoss = Callable[..., "tuple[Tensor, dict[str, Tensor]]"]

POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": ppo_policy_loss,
    "gspo": gspo_policy_loss,
}
