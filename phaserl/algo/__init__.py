"""phaserl.algo: the pure tensor math of RL post-training.

Advantages, policy and value losses, KL penalties and controllers, loss aggregation and chunked
log-probs. No nn.Module, no torch.distributed, no I/O, nothing from other phaserl subpackages but
`phaserl.errors`; the trainer picks estimators and losses once from the registries below.

    masked       masked_sum / masked_mean / masked_var / masked_whiten, upcast (the compute dtype)
    advantages   AdvantageInputs, ADVANTAGE_ESTIMATORS (gae, grpo, rloo, reinforce_plus_plus(_baseline), remax)
    policy_loss  POLICY_LOSSES (ppo, gspo)
    value_loss   clipped_value_loss
    kl           kl_penalty, apply_kl_to_rewards, FixedKLController, AdaptiveKLController
    aggregation  aggregate, LOSS_AGG_MODES
    logprobs     token_logprobs_from_hidden, token_logprobs_from_logits, entropy_from_logits
"""
from phaserl.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_gae_advantages,
    compute_grpo_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_reinforce_plus_plus_baseline_advantages,
    compute_remax_advantages,
    compute_rloo_advantages,
)
from phaserl.algo.aggregation import LOSS_AGG_MODES, aggregate
from phaserl.algo.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_to_rewards,
    kl_penalty,
)
from phaserl.algo.logprobs import entropy_from_logits, token_logprobs_from_hidden, token_logprobs_from_logits
from phaserl.algo.masked import masked_mean, masked_sum, masked_var, masked_whiten, upcast
from phaserl.algo.policy_loss import POLICY_LOSSES, gspo_policy_loss, ppo_policy_loss
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
    "LOSS_AGG_MODES",
    "aggregate",
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "apply_kl_to_rewards",
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
    "gspo_policy_loss",
    "ppo_policy_loss",
    "clipped_value_loss",
]
