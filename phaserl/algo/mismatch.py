"""Rollout/training mismatch: how far the sampler's log-probs are from the trainer's, and corrections.

The rollout engine (or transformers' generate path) reports log pi_rollout(y_t) for every sampled
token; the trainer recomputes log pi_train(y_t) for the same tokens under the same weights. Both are
log-probs of softmax(logits / T) over the full vocabulary at the rollout temperature T (the sampler's
top-k/top-p filters choose the token but do not renormalise the reported log-prob), so in exact
arithmetic they are equal; kernels, precision and batching make them differ. With
rho_t = pi_train(y_t) / pi_rollout(y_t):

    mismatch metrics   k3 of KL(rollout || train) (Schulman 2020), mean and max |log rho|, and the
                       share of tokens with rho outside [0.5, 2]
    corrections        a per-token weight w [B, T] (detached) the caller multiplies into any policy
                       loss before aggregation; rejected tokens get w = 0 and still count in the
                       aggregation's denominators (the mini-batch's token/response counts), so the
                       correction keeps the loss split- and rank-invariant
        tis            w = min(rho, C)                    truncated IS (Yao et al. 2025, "Your efficient
                                                          RL framework secretly brings you off-policy RL
                                                          training"; verl rollout_is=token)
        icepop         w = rho if 1/C <= rho <= C else 0  IcePop (Ling Team 2025, "Small leak can sink
                                                          a great ship"): masked and reweighted
        masked_is      w = 1 if 1/C <= rho <= C else 0    masked IS: tokens outside the band dropped,
                                                          no reweighting (verl's token-level rejection)
        decoupled      w = rho if rho <= C else 0         decoupled PPO (Fu et al. 2025, AReaL, arXiv
                                                          2505.24298): the trainer's pre-update log-probs are
                                                          the proximal policy, the sampler's (possibly older
                                                          versions') the behaviour policy; tokens whose weight
                                                          passes the cap are masked, as AReaL's
                                                          behav_imp_weight_cap
        seq_mask       w = 1 for the whole response if 1/C <= exp(mean_t log rho_t) <= C, else 0
                                                          sequence-level masking by the geometric mean
                                                          ratio (verl rollout_rs=seq_mean_k1; Liu et al.
                                                          2025, "When speed kills stability")

Pure tensor math under no_grad. Legend: B = responses, T = response tokens, mask = response_mask [B, T].
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from phaserl.algo.masked import masked_mean, masked_sum
from phaserl.algo.ratio import LOG_RATIO_BOUND
from phaserl.errors import ConfigError

# The band of the logged "ratio outside" share (the issue's [0.5, 2]; a correction's band is its own C).
METRIC_BAND = 2.0


def _log_rho(trainer_logprobs: Tensor, rollout_logprobs: Tensor, dtype=None) -> Tensor:
    dtype = dtype or torch.promote_types(trainer_logprobs.dtype, torch.float32)
    diff = trainer_logprobs.detach().to(dtype) - rollout_logprobs.to(dtype)  # [B, T] log rho
    return diff.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


@torch.no_grad()
def mismatch_sums(trainer_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Sums over the real tokens (0-dim tensors) to be divided by a token count, plus the max.

    Returns {"k3": sum of (1/rho - 1) + log rho, "abs_diff": sum of |log rho|, "ratio_out": tokens with
    rho outside [0.5, 2], "abs_diff_max": max |log rho| (0 with no real token)}. The k3 term estimates
    KL(rollout || train) from the rollout's own samples. Sums, so that micro-batches and ranks add up.
    """
    # float64: k3 is ~ (log rho)^2 / 2, which float32 rounds to 0 below |log rho| ~ 1e-4
    log_rho = _log_rho(trainer_logprobs, rollout_logprobs, torch.float64)  # [B, T]
    k3 = torch.exp(-log_rho) - 1.0 + log_rho
    outside = (log_rho.abs() > torch.log(torch.tensor(METRIC_BAND))).float()
    abs_diff = log_rho.abs()
    top = abs_diff.masked_fill(~mask.bool(), 0.0).max() if abs_diff.numel() else abs_diff.new_zeros(())
    sums = {"k3": masked_sum(k3, mask), "abs_diff": masked_sum(abs_diff, mask),
            "ratio_out": masked_sum(outside, mask), "abs_diff_max": top}
    return {k: v.float() for k, v in sums.items()}


def mismatch_metrics(trainer_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """The logged metrics of one batch: mismatch/k3, abs_diff_mean, abs_diff_max, ratio_out_frac."""
    sums = mismatch_sums(trainer_logprobs, rollout_logprobs, mask)
    tokens = max(float(mask.sum()), 1.0)
    return {"mismatch/k3": float(sums["k3"]) / tokens, "mismatch/abs_diff_mean": float(sums["abs_diff"]) / tokens,
            "mismatch/abs_diff_max": float(sums["abs_diff_max"]),
            "mismatch/ratio_out_frac": float(sums["ratio_out"]) / tokens}


def _band(log_rho: Tensor, cap: float) -> Tensor:
    return log_rho.abs() <= torch.log(torch.tensor(float(cap), dtype=log_rho.dtype))


def _tis(log_rho: Tensor, mask: Tensor, cap: float) -> Tensor:
    return torch.exp(log_rho).clamp(max=cap)


def _icepop(log_rho: Tensor, mask: Tensor, cap: float) -> Tensor:
    return torch.where(_band(log_rho, cap), torch.exp(log_rho), torch.zeros_like(log_rho))


def _masked_is(log_rho: Tensor, mask: Tensor, cap: float) -> Tensor:
    return _band(log_rho, cap).to(log_rho.dtype)


def _seq_mask(log_rho: Tensor, mask: Tensor, cap: float) -> Tensor:
    seq_log_rho = masked_mean(log_rho, mask, dim=-1)  # [B] log of the geometric mean ratio
    keep = _band(seq_log_rho, cap).to(log_rho.dtype)  # [B]
    return keep.unsqueeze(-1).expand_as(log_rho)


def _decoupled(log_rho: Tensor, mask: Tensor, cap: float) -> Tensor:
    return torch.where(log_rho <= torch.log(torch.tensor(float(cap), dtype=log_rho.dtype)), torch.exp(log_rho),
                       torch.zeros_like(log_rho))


# (log rho [B, T], mask [B, T], C) -> weights [B, T]
ROLLOUT_CORRECTIONS: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {
    "tis": _tis, "icepop": _icepop, "masked_is": _masked_is, "seq_mask": _seq_mask, "decoupled": _decoupled,
}


@torch.no_grad()
def rollout_correction(trainer_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, *, mode: str,
                       cap: float) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-token weight of correction `mode` (see the module docstring) with cap/band C = `cap`.

    Args:
        trainer_logprobs: [B, T] the trainer's log-probs of the sampled tokens before the update.
        rollout_logprobs: [B, T] the sampler's log-probs of the same tokens.
        mask: [B, T] response mask.
        mode: one of ROLLOUT_CORRECTIONS.
        cap: C > 1.

    Returns:
        (weights [B, T] detached, 0 beyond the mask; stats as sums over real tokens: "rejected"
        tokens with weight 0, "weight" the sum of the weights).
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ConfigError(f"algorithm.rollout_correction={mode!r} is unknown; use none or one of "
                          f"{', '.join(ROLLOUT_CORRECTIONS)}")
    if cap <= 1.0:
        raise ConfigError(f"algorithm.rollout_correction_cap must be > 1 (TIS's cap, the band [1/C, C] of the "
                          f"masks; 2.0 is usual for tokens, 1.01 or less for seq_mask), got {cap}")
    log_rho = _log_rho(trainer_logprobs, rollout_logprobs)  # [B, T]
    weights = ROLLOUT_CORRECTIONS[mode](log_rho, mask, cap)
    weights = torch.where(mask.bool(), weights, torch.zeros((), dtype=weights.dtype, device=weights.device))
    stats = {"rejected": masked_sum((weights == 0).float(), mask), "weight": masked_sum(weights, mask)}
    return weights, stats
