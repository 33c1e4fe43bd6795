"""The 2025-26 policy losses next to PPO and GSPO: CISPO, SAPO, GMPO, DRO, DPPO (TV / KL) and GPG.

Same contract as `policy_loss`: each returns a per-token loss [B, T] (0 beyond the mask) for
`aggregation.aggregate` and detached 0-dim stats over the real tokens, with at least `clipfrac`
(tokens whose gradient the loss cuts or bounds; 0 where nothing is cut) and `approx_kl` (k3 of
KL(old || new)). Each takes only its own hyper-parameters as keyword arguments; the builder binds
them once (`functools.partial`). All follow verl's `core_algos.py` (2026-08) unless a difference is
stated. verl aggregates inside the loss; here aggregation is the caller's (`actor.loss_agg_mode`),
which is how every loss composes with every mode and with the rollout corrections (a per-token
weight the caller multiplies in).

Legend: B = responses, T = response tokens (right-padded), mask = response_mask [B, T],
r = exp(logprobs - old_logprobs) per token, A = advantages, sg = stop-gradient.
"""
from __future__ import annotations

import torch
from torch import Tensor

from phaserl.algo.masked import masked_mean, upcast
from phaserl.algo.ratio import LOG_RATIO_BOUND, approx_kl, bounded_ratio, check_clip, zero_padding
from phaserl.errors import ConfigError


def _log_ratio(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    return upcast(logprobs) - upcast(old_logprobs)  # [B, T]


def _stats(log_ratio: Tensor, mask: Tensor, cut: Tensor) -> dict[str, Tensor]:
    with torch.no_grad():
        ratio = bounded_ratio(log_ratio.detach())
        return {"clipfrac": masked_mean(cut.float(), mask), "approx_kl": approx_kl(log_ratio, mask),
                "ratio_mean": masked_mean(ratio, mask),
                "ratio_max": ratio.masked_fill(~mask.bool(), float("-inf")).max()}


def cispo_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                      clip_low: float, clip_high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, never the gradient.

        loss = -sg[clip(r, 1 - clip_low, 1 + clip_high)] * A * logprobs
    Unlike PPO no token loses its gradient: a token far outside the range still contributes, with
    its weight capped. `clip_low = 1` removes the lower bound (the paper's choice); `clipfrac`
    counts tokens whose weight was capped.
    """
    check_clip(clip_low, clip_high, None, low_inclusive=True)
    log_ratio = _log_ratio(logprobs, old_logprobs)
    ratio = bounded_ratio(log_ratio)
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high).detach()  # [B, T]
    loss = zero_padding(-weight * upcast(advantages) * upcast(logprobs), mask)
    return loss, _stats(log_ratio, mask, weight != ratio)


def sapo_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                     tau_pos: float, tau_neg: float) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Qwen, "Soft Adaptive Policy Optimization", arXiv 2511.20347): a smooth gate for the hard clip.

        loss = -f(r) * A,   f(r) = sigmoid(tau (r - 1)) * 4 / tau,   tau = tau_pos if A > 0 else tau_neg
    f'(1) = 1, so at r = 1 the gradient is the plain policy gradient; it then fades smoothly as r
    leaves 1 (faster for negative advantages, tau_neg > tau_pos, the paper's 1.05 vs 1.0).
    Difference from verl: verl always aggregates SAPO with seq-mean-token-mean whatever the mode;
    here the configured mode applies (the recipe, examples/sapo.yaml, sets seq-mean-token-mean).
    `clipfrac` is 0 (nothing is cut).
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ConfigError(f"actor.sapo_tau_pos and actor.sapo_tau_neg must be > 0, got {tau_pos} and {tau_neg} "
                          "(the paper uses 1.0 and 1.05)")
    log_ratio = _log_ratio(logprobs, old_logprobs)
    adv = upcast(advantages)
    tau = torch.where(adv > 0, torch.tensor(float(tau_pos)), torch.tensor(float(tau_neg))).to(adv)  # [B, T]
    gate = torch.sigmoid(tau * (bounded_ratio(log_ratio) - 1.0)) * (4.0 / tau)
    loss = zero_padding(-gate * adv, mask)
    return loss, _stats(log_ratio, mask, torch.zeros_like(mask, dtype=torch.bool))


def gmpo_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                     clip_low: float, clip_high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv 2507.20673).

    The sequence's ratio is the geometric mean of its token ratios, with each log r clipped to
    [-clip_low, clip_high] in log space (the paper's range is 0.4 each way, e^±0.4) on the side that
    limits the update (sign-aware, like PPO's min):
        l_t = sgn(A) * min(sgn(A) log r_t, sgn(A) clip(log r_t)),   R_i = exp(mean_t l_t)
        loss_i = -A_i R_i,   A_i = token mean of the advantages of response i
    loss_i is written on every real token of response i, so "seq-mean-token-mean" gives the paper's
    (and verl's) mean over responses; another mode weights responses by it (token-mean: by length).
    Difference from verl: verl ignores the aggregation mode (always the mean over responses) and
    takes the geometric mean of per-token correction weights; here the configured mode applies and
    the caller's correction weight multiplies each token's copy (its token mean, under
    seq-mean-token-mean). `clipfrac` counts tokens whose log-ratio was clipped.
    """
    if clip_low < 0 or clip_high < 0:
        raise ConfigError(f"actor.clip_ratio_low/high are GMPO's log-space clip range and must be >= 0, got "
                          f"{clip_low} and {clip_high} (the paper uses 0.4 each)")
    log_ratio = _log_ratio(logprobs, old_logprobs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    adv = upcast(advantages)
    sign = torch.sign(adv)
    clipped = log_ratio.clamp(-clip_low, clip_high)
    limited = sign * torch.minimum(sign * log_ratio, sign * clipped)  # [B, T]
    seq_ratio = torch.exp(masked_mean(limited, mask, dim=-1))  # [B]
    seq_adv = masked_mean(adv, mask, dim=-1)  # [B]
    loss = zero_padding((-seq_adv * seq_ratio).unsqueeze(-1).expand_as(log_ratio), mask)
    return loss, _stats(log_ratio, mask, clipped != log_ratio)


def dro_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                    beta: float) -> tuple[Tensor, dict[str, Tensor]]:
    """DRO as verl's `dro` loss: the policy gradient with a quadratic log-ratio penalty.

        loss = -(A * logprobs - beta/2 * (log r)^2)
    The penalty (k2 of the old policy, in the loss) keeps the update close to the policy that
    sampled, in place of clipping: the regularised objective of Direct Reward Optimization
    (Richemond et al. 2024, arXiv 2405.19107) in the on-policy form verl implements, not the paper's
    offline value-function form. `clipfrac` is 0.
    """
    if beta <= 0:
        raise ConfigError(f"actor.dro_beta must be > 0 (the weight of the log-ratio penalty), got {beta}")
    log_ratio = _log_ratio(logprobs, old_logprobs)
    loss = zero_padding(-(upcast(advantages) * upcast(logprobs) - 0.5 * beta * log_ratio.square()), mask)
    return loss, _stats(log_ratio, mask, torch.zeros_like(mask, dtype=torch.bool))


def _dppo(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, inside: Tensor,
          ratio_cap: float) -> tuple[Tensor, dict[str, Tensor]]:
    """-A * sg[min(r, cap)] * logprobs on the tokens `inside` the trust region, 0 elsewhere."""
    if ratio_cap <= 1.0:
        raise ConfigError(f"actor.dppo_ratio_cap must be > 1 (the paper's 20 keeps the truncation bias small), "
                          f"got {ratio_cap}")
    log_ratio = _log_ratio(logprobs, old_logprobs)
    weight = bounded_ratio(log_ratio).clamp(max=ratio_cap).detach()  # [B, T]
    loss = zero_padding(-upcast(advantages) * weight * upcast(logprobs) * inside.detach().to(weight.dtype), mask)
    return loss, _stats(log_ratio, mask, ~inside)


def _check_thresholds(delta_low: float, delta_high: float, paper: str) -> None:
    if delta_low <= 0 or delta_high <= 0:
        raise ConfigError(f"the DPPO thresholds must be > 0 (the paper uses {paper}), got {delta_low} where A <= 0 "
                          f"(actor.clip_ratio_low) and {delta_high} where A > 0 (actor.clip_ratio_high); "
                          "actor.dppo_delta sets both")


def dppo_tv_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                        delta_low: float, delta_high: float, ratio_cap: float) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-TV (Qi et al. 2026, "Rethinking the Trust Region in LLM RL", arXiv 2602.04879).

    PPO's ratio clip judges a token by pi / pi_old, which over-punishes rare tokens and under-punishes
    likely ones; DPPO masks a token by the (binary) total variation of its probability change:
        inside = (p - p_old <= delta_high) where A > 0,  (p - p_old >= -delta_low) where A <= 0
        loss = -A * sg[min(r, ratio_cap)] * logprobs * inside
    (p = exp(logprobs)); the capped ratio is truncated IS in place of dual-clip. As verl, the threshold
    depends on the sign of the advantage: delta_low = actor.clip_ratio_low, delta_high = actor.clip_ratio_high
    (verl's names, the same meaning); actor.dppo_delta is one value for both (the paper: 0.15).
    ratio_cap = actor.dppo_ratio_cap (verl's clip_ratio_c; the paper's 20). `clipfrac` counts the masked tokens.
    """
    _check_thresholds(delta_low, delta_high, "0.15 for TV")
    diff = torch.exp(upcast(logprobs)) - torch.exp(upcast(old_logprobs))  # [B, T] p - p_old
    inside = torch.where(upcast(advantages) > 0, diff <= delta_high, diff >= -delta_low)
    return _dppo(logprobs, old_logprobs, advantages, mask, inside, ratio_cap)


def dppo_kl_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                        delta_low: float, delta_high: float, ratio_cap: float) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-KL (arXiv 2602.04879; prime-rl's default loss with a KL term): DPPO-TV with the KL
    between the old and new Bernoulli(p) of the sampled token as the divergence:
        kl = p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p))
        inside = (kl <= delta_high or p <= p_old) where A > 0,  (kl <= delta_low or p >= p_old) where A <= 0
    i.e. only a move *further* in the advantage's direction beyond the threshold is masked. Thresholds by
    the advantage's sign as `dppo_tv_policy_loss` (the paper: 0.05 both ways), ratio_cap 20 (verl adds 1e-8
    inside the logs, as here).
    """
    _check_thresholds(delta_low, delta_high, "0.05 for KL")
    logp, old = upcast(logprobs).detach(), upcast(old_logprobs)
    p, p_old = torch.exp(logp), torch.exp(old)
    kl = p_old * (old - logp) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))  # [B, T]
    inside = torch.where(upcast(advantages) > 0, (kl <= delta_high) | (p <= p_old), (kl <= delta_low) | (p >= p_old))
    return _dppo(logprobs, old_logprobs, advantages, mask, inside, ratio_cap)


def gpg_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                    mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG (Chu et al. 2025, arXiv 2504.02546): the plain policy gradient, loss = -A * logprobs.

    No ratio, no clip: meant for one optimizer step per batch (ppo.epochs 1, one mini-batch), where
    PPO's ratio is 1 anyway. With `algorithm.adv_estimator=gpg`. `clipfrac` is 0.
    """
    log_ratio = _log_ratio(logprobs, old_logprobs)
    loss = zero_padding(-upcast(advantages) * upcast(logprobs), mask)
    return loss, _stats(log_ratio, mask, torch.zeros_like(mask, dtype=torch.bool))

