"""KL between the policy and the frozen reference: per-token estimators and coefficient controllers.

The KL goes either into the reward (`apply_kl_to_rewards`, before the advantage) or into the loss
(the caller aggregates `kl_coef * kl_penalty(...)` like any per-token loss). Estimators follow
Schulman, "Approximating KL Divergence" (2020), with samples drawn from the policy:
log r = logprobs - ref_logprobs.

Legend: B = responses, T = response tokens (right-padded), mask = response_mask [B, T].
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from phaserl.algo.masked import upcast
from phaserl.errors import ConfigError

# Same bounds as verl: exp() of a log-ratio beyond +-20 overflows in bf16 and says nothing useful;
# a per-token k3 above 10 is already a broken run, clamping keeps one token from dominating.
_LOG_RATIO_BOUND = 20.0
_K3_BOUND = 10.0


def kl_k1(log_ratio: Tensor) -> Tensor:
    """k1 = log r: unbiased for KL(policy || ref), high variance, can be negative."""
    return log_ratio


def kl_k2(log_ratio: Tensor) -> Tensor:
    """k2 = 0.5 (log r)^2: biased but low variance, always >= 0; its gradient is the true KL's."""
    return 0.5 * log_ratio.square()


def kl_k3(log_ratio: Tensor) -> Tensor:
    """k3 = (r_inv - 1) - log r_inv with r_inv = exp(ref - logp): unbiased, >= 0, low variance.

    Clamped to [-10, 10] (verl's range) after bounding log r to [-20, 20].
    """
    neg = (-log_ratio).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)  # log r_inv
    return (torch.exp(neg) - 1.0 - neg).clamp(-_K3_BOUND, _K3_BOUND)


def kl_abs(log_ratio: Tensor) -> Tensor:
    """abs = |log r|: always >= 0, biased; verl's `abs`. Its gradient is sign(log r), not the KL's."""
    return log_ratio.abs()


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3, "abs": kl_abs}

# The estimator of the logged `train/kl` (policy to reference, token mean), whatever algorithm.kl_estimator is:
# k3 is unbiased and never negative, so the curve reads as a KL in every run.
TRAIN_KL_ESTIMATOR = "k3"

# verl's names for the same estimators (`algorithm.kl_penalty` / `actor.kl_loss_type`).
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}

# Every accepted `algorithm.kl_estimator`: the base estimators, verl's aliases, and each with "+" appended:
# the straight-through variant (the value of the base estimator, the gradient of k2).
KL_ESTIMATOR_NAMES = tuple(name + plus for name in (*KL_ESTIMATORS, *KL_ALIASES) for plus in ("", "+"))


def canonical_kl_estimator(name: str) -> str:
    """verl's alias resolved, the "+" kept ("low_var_kl+" -> "k3+"); a ConfigError naming the choices."""
    base, plus = (name[:-1], "+") if name.endswith("+") else (name, "")
    base = KL_ALIASES.get(base, base)
    if base not in KL_ESTIMATORS:
        raise ConfigError(f"algorithm.kl_estimator={name!r} is unknown; use one of {', '.join(KL_ESTIMATOR_NAMES)}")
    return base + plus


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token KL estimate of the policy from the reference (Schulman 2020's k1/k2/k3, and abs).

    A name ending in "+" is the straight-through variant (verl's `k1+`, `k3+`): its value is the base
    estimator's, its gradient k2's, whose expected gradient is the true KL's (k1's and k3's are not):
        kl = k2 - sg[k2] + sg[base]          (sg = stop-gradient)
    verl's names `kl`, `mse`, `low_var_kl` are k1, k2, k3. As in verl, `k2+` is k2 itself.

    Args:
        logprobs: [B, T] log-probs of the sampled tokens under the policy.
        ref_logprobs: [B, T] the same tokens under the reference policy.
        estimator: one of `KL_ESTIMATOR_NAMES`.

    Returns:
        [B, T] (at least float32), not masked (padding holds whatever its inputs give). Differentiable in
        `logprobs`, so it also serves as the KL-in-loss term.
    """
    name = canonical_kl_estimator(estimator)
    log_ratio = upcast(logprobs) - upcast(ref_logprobs)  # [B, T]
    if not name.endswith("+"):
        return KL_ESTIMATORS[name](log_ratio)
    value = KL_ESTIMATORS[name[:-1]](log_ratio.detach())
    k2 = kl_k2(log_ratio)
    return k2 - k2.detach() + value


def apply_kl_to_rewards(token_rewards: Tensor, logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor,
                        coef: float, estimator: str) -> tuple[Tensor, Tensor]:
    """Shape the KL into the reward, per token: r'_t = r_t - coef * kl_t (Ziegler et al. 2019).

    Args:
        token_rewards: [B, T] score on the last real token, 0 elsewhere.
        logprobs, ref_logprobs: [B, T] policy / reference log-probs of the sampled tokens.
        mask: [B, T] response mask.
        coef: KL coefficient (the controller's `.value`).
        estimator: "k1", "k2" or "k3".

    Returns:
        (new token rewards [B, T], kl [B, T]), both 0 beyond the mask. The controller's
        `current_kl` is usually `masked_mean(kl, mask, dim=-1).mean()`.
    """
    real = mask.bool()
    zero = torch.zeros((), device=token_rewards.device)
    kl = torch.where(real, kl_penalty(logprobs, ref_logprobs, estimator), zero)  # [B, T]
    rewards = torch.where(real, upcast(token_rewards) - coef * kl, zero)  # [B, T]
    return rewards, kl


class FixedKLController:
    """A constant KL coefficient (Ziegler et al. 2019, the non-adaptive case)."""

    def __init__(self, coef: float):
        if coef < 0:
            raise ConfigError(f"algorithm.kl_coef must be >= 0, got {coef}")
        self.value = float(coef)

    def update(self, current_kl: float, n_responses: int) -> None:
        """Nothing to adapt; present so the trainer treats both controllers alike."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 ("Fine-Tuning LMs from Human Preferences").

    After each step: e = clip(current_kl / target - 1, -0.2, 0.2) and
        value *= 1 + e * min(n_responses / horizon, 1)
    which drives the measured KL towards `target`. `horizon` is in responses: while the KL stays off
    target by 20% or more, the coefficient moves by a factor of about 1.2 (up) or 0.8 (down) every
    `horizon` responses, whatever the step size.

    Differences from Ziegler et al. and verl (whose multiplier is 1 + e * n / horizon): a step with more than
    `horizon` responses moves the coefficient by one horizon's worth, not more, so the multiplier stays in
    [0.8, 1.2] (verl's turns negative beyond 5 horizons per step, and a negative coefficient rewards moving
    away from the reference); and the coefficient stays within a factor of `COEF_RANGE` (100) of the initial
    one either way, so a KL that stays off target cannot drive it to 0 or to a value that drowns the reward.
    """

    COEF_RANGE = 100.0  # value stays in [init / COEF_RANGE, init * COEF_RANGE]

    def __init__(self, init_coef: float, target: float, horizon: int):
        if init_coef <= 0:
            raise ConfigError(f"algorithm.kl_coef must be > 0 for the adaptive controller (algorithm.kl_target is "
                              f"set), got {init_coef}: the controller scales it, and 0 stays 0")
        if target <= 0:
            raise ConfigError(f"algorithm.kl_target must be > 0 for the adaptive controller, got {target}; "
                              "set it to null for a fixed coefficient")
        if horizon < 1:
            raise ConfigError(f"algorithm.kl_horizon must be >= 1, got {horizon}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = int(horizon)
        self.low, self.high = init_coef / self.COEF_RANGE, init_coef * self.COEF_RANGE

    def update(self, current_kl: float, n_responses: int) -> None:
        """Adapt `value` to the KL measured on a step that used `n_responses` responses."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * min(n_responses / self.horizon, 1.0)  # in [0.8, 1.2]
        self.value = min(max(self.value, self.low), self.high)

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
