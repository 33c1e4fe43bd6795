"""Policy-gradient losses: PPO's clipped surrogate (token ratio), GSPO (sequence ratio), and the registry.

The other families (CISPO, SAPO, GMPO, DRO, DPPO, GPG) live in `policy_loss_families`; every loss is
in `POLICY_LOSSES`, and `bind_policy_loss` binds its hyper-parameters once.

Every loss returns a per-token loss [B, T] (0 beyond the mask) that the caller turns into one number with
`aggregation.aggregate`, plus detached statistics over the real tokens of this batch. The entropy
bonus and the KL-in-loss term are separate per-token terms the caller adds before aggregating.
The trainer picks one from `POLICY_LOSSES` when the run is built; all share one positional signature
and each declares its own keyword-only hyper-parameters (PPO and GSPO: clip_low, clip_high, dual_clip_c):

    fn(logprobs, old_logprobs, advantages, mask, *, <its hyper-parameters>) -> (loss, stats)

Legend: B = responses, T = response tokens (right-padded), mask = response_mask [B, T].
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional

import torch
from torch import Tensor

from phaserl.algo.masked import masked_mean, upcast
from phaserl.algo.policy_loss_families import (
    cispo_policy_loss,
    dppo_kl_policy_loss,
    dppo_tv_policy_loss,
    dro_policy_loss,
    gmpo_policy_loss,
    gpg_policy_loss,
    sapo_policy_loss,
)
from phaserl.algo.ratio import approx_kl as _approx_kl
from phaserl.algo.ratio import bounded_ratio, check_clip, zero_padding
from phaserl.errors import ConfigError


def _clipped_surrogate(log_ratio: Tensor, advantages: Tensor, mask: Tensor, clip_low: float,
                       clip_high: float, dual_clip_c: Optional[float]) -> tuple[Tensor, dict[str, Tensor]]:
    """max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), then min(., -A c) where A < 0."""
    ratio = bounded_ratio(log_ratio)  # [B, T]
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)  # [B, T]
    dual_clipped = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip_c is not None:
        # Dual-clip (Ye et al. 2020): with A < 0 a huge ratio would make the loss unbounded; cap it at -A c.
        cap = -advantages * dual_clip_c
        dual_clipped = (advantages < 0) & (loss > cap)
        loss = torch.where(dual_clipped, cap, loss)
    loss = zero_padding(loss, mask)
    with torch.no_grad():
        real = mask.bool()
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).float(), mask),
            "clipfrac_dual": masked_mean(dual_clipped.float(), mask),
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_max": ratio.masked_fill(~real, float("-inf")).max(),  # -inf with no real token
        }
    return loss, stats


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
    check_clip(clip_low, clip_high, dual_clip_c)
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
    check_clip(clip_low, clip_high, dual_clip_c)
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
    "cispo": cispo_policy_loss,
    "sapo": sapo_policy_loss,
    "gmpo": gmpo_policy_loss,
    "dro": dro_policy_loss,
    "dppo_tv": dppo_tv_policy_loss,
    "dppo_kl": dppo_kl_policy_loss,
    "gpg": gpg_policy_loss,
}

# verl's `actor.policy_loss.loss_mode` names with the same meaning.
POLICY_LOSS_ALIASES = {"vanilla": "ppo", "geo_mean": "gmpo"}


def bind_policy_loss(name: str, **hyper: object) -> Callable[[Tensor, Tensor, Tensor, Tensor], tuple]:
    """The loss `name` (or its verl alias) with its own hyper-parameters bound, picked from `hyper`.

    The builder passes every loss hyper-parameter it has; each loss receives only the keyword
    arguments it declares, so the update calls every loss alike: fn(logprobs, old, advantages, mask).
    """
    canonical = POLICY_LOSS_ALIASES.get(name, name)
    if canonical not in POLICY_LOSSES:
        raise ConfigError(f"actor.policy_loss={name!r} is unknown; use one of "
                          f"{', '.join([*POLICY_LOSSES, *POLICY_LOSS_ALIASES])}")
    fn = POLICY_LOSSES[canonical]
    wanted = [p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY]
    missing = [k for k in wanted if k not in hyper]
    if missing:
        raise TypeError(f"policy loss {canonical} needs {missing}")
    return functools.partial(fn, **{k: hyper[k] for k in wanted})
