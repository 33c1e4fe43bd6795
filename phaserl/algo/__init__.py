"""phaserl.algo: the pure tensor math of RL post-training.

Advantages, policy and value losses, KL penalties and controllers, loss aggregation and chunked
log-probs. No nn.Module, no torch.distributed, no I/O, nothing from other phaserl subpackages but
`phaserl.errors`; the trainer picks estimators and losses once from the registries below.

    masked       masked_sum / masked_mean / masked_var / masked_whiten, upcast (the compute dtype)
    advantages   AdvantageInputs, ADVANTAGE_ESTIMATORS (gae, grpo, grpo_passk, opo, gpg, rloo,
                 reinforce_plus_plus(_baseline), remax), group_has_variance
    policy_loss  POLICY_LOSSES (ppo, gspo + the families), bind_policy_loss
    policy_loss_families  cispo, sapo, gmpo, dro, dppo_tv, dppo_kl, gpg
    ratio        the importance ratio's bound, k3 and clip checks shared by the losses
    value_loss   clipped_value_loss
    kl           kl_penalty (k1/k2/k3/abs, verl aliases, straight-through "+"), apply_kl_to_rewards, controllers
    aggregation  aggregate, LOSS_AGG_MODES (+ token-sum)
    mismatch     rollout/training mismatch metrics and corrections (TIS, IcePop, masked IS, seq_mask)
    reward_shaping  overlong_penalty (DAPO)
    logprobs     token_logprobs_from_hidden, token_logprobs_from_logits, entropy_from_logits
"""
from phaserl.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_gae_advantages,
    compute_gpg_advantages,
    compute_grpo_advantages,
    compute_opo_advantages,
    compute_passk_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_reinforce_plus_plus_baseline_advantages,
    compute_remax_advantages,
    compute_rloo_advantages,
    group_has_variance,
)
from phaserl.algo.aggregation import LOSS_AGG_MODES, aggregate
from phaserl.algo.kl import (
    KL_ESTIMATOR_NAMES,
    KL_ESTIMATORS,
    TRAIN_KL_ESTIMATOR,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_to_rewards,
    canonical_kl_estimator,
    kl_penalty,
)
from phaserl.algo.logprobs import entropy_from_logits, token_logprobs_from_hidden, token_logprobs_from_logits
from phaserl.algo.masked import masked_mean, masked_sum, masked_var, masked_whiten, upcast
from phaserl.algo.mismatch import ROLLOUT_CORRECTIONS, mismatch_metrics, mismatch_sums, rollout_correction
from phaserl.algo.policy_loss import (
    POLICY_LOSS_ALIASES,
    POLICY_LOSSES,
    bind_policy_loss,
    gspo_policy_loss,
    ppo_policy_loss,
)
from phaserl.algo.reward_shaping import overlong_penalty
from phaserl.algo.value_loss import clipped_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageInputs",
    "compute_gae_advantages",
    "compute_grpo_advantages",
    "compute_reinforce_plus_plus_advantages",
    "compute_reinforce_plus_plus_baseline_advantages",
    "compute_remax_advantages",
    "compute_rloo_advantages",
    "compute_passk_advantages",
    "compute_opo_advantages",
    "compute_gpg_advantages",
    "group_has_variance",
    "LOSS_AGG_MODES",
    "aggregate",
    "KL_ESTIMATORS",
    "KL_ESTIMATOR_NAMES",
    "AdaptiveKLController",
    "FixedKLController",
    "apply_kl_to_rewards",
    "TRAIN_KL_ESTIMATOR",
    "canonical_kl_estimator",
    "kl_penalty",
    "entropy_from_logits",
    "token_logprobs_from_hidden",
    "token_logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "upcast",
    "POLICY_LOSSES",
    "POLICY_LOSS_ALIASES",
    "bind_policy_loss",
    "ROLLOUT_CORRECTIONS",
    "mismatch_metrics",
    "mismatch_sums",
    "rollout_correction",
    "overlong_penalty",
    "gspo_policy_loss",
    "ppo_policy_loss",
    "clipped_value_loss",
]
