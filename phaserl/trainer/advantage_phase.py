"""Phase 5 (advantage): scores → token rewards (optionally minus KL) → advantages and returns.

The estimator and the KL placement are chosen when the run is built (`AdvantageSettings`); this
module only applies them, and names the likely cause when advantages come out non-finite.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..algo import AdvantageInputs, apply_kl_to_rewards, group_has_variance
from ..batch import RolloutBatch
from ..parallel import all_reduce_sum, is_distributed, rank_and_world

log = logging.getLogger("phaserl")


@dataclass(frozen=True)
class AdvantageSettings:
    estimator: Callable          # algo.ADVANTAGE_ESTIMATORS[name]
    gamma: float
    lam: float
    norm_by_std: bool
    kl_in_reward: bool
    kl_estimator: str


def place_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Put each response's score on its last real token.  scores [B] → token rewards [B, R]

    Given the loss mask of a multi-turn batch, "real" means sampled: the last model token.
    """
    token_rewards = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    columns = torch.arange(response_mask.shape[1], device=response_mask.device)
    last = torch.where(response_mask > 0, columns, -1).amax(dim=1).clamp(min=0)  # [B] last real column
    token_rewards[torch.arange(len(scores), device=scores.device), last] = scores.float()
    return token_rewards * response_mask


def compute_advantages(batch: RolloutBatch, scores: torch.Tensor, s: AdvantageSettings, *,
                       old_logprobs: torch.Tensor, ref_logprobs: Optional[torch.Tensor],
                       values: Optional[torch.Tensor], kl_coef: float,
                       baseline_scores: Optional[torch.Tensor] = None,
                       token_rewards: Optional[torch.Tensor] = None) -> tuple:
    """Returns (advantages [B, R], returns [B, R], token_rewards [B, R], kl [B, R] or None).

    The mask is the batch's loss mask: observation tokens of multi-turn episodes are holes the
    estimators skip (GAE carries its running value across them). `token_rewards` [B, R] places the
    scores where the score phase put them (per-turn rewards); None = each score on its last sampled token.
    """
    mask = batch.loss_mask.float()                                           # [B, R]
    if token_rewards is None:
        token_rewards = place_scores(scores, mask)                           # [B, R]
    else:
        token_rewards = token_rewards.float() * mask
    kl = None
    if s.kl_in_reward:
        token_rewards, kl = apply_kl_to_rewards(token_rewards, old_logprobs, ref_logprobs, mask,
                                                coef=kl_coef, estimator=s.kl_estimator)
    advantages, returns = s.estimator(AdvantageInputs(
        token_rewards=token_rewards, response_mask=mask, group_ids=batch.group_ids, values=values,
        baseline_scores=baseline_scores, gamma=s.gamma, lam=s.lam, norm_by_std=s.norm_by_std,
        total=all_reduce_sum if is_distributed() else None))  # whiten with the global batch's statistics
    return advantages, returns, token_rewards, kl


def nonfinite_advantage_cause(advantages: torch.Tensor, scores: torch.Tensor,
                              values: Optional[torch.Tensor]) -> Optional[str]:
    """None when advantages are finite; else the likely cause (mistake 2 of the five, reward-model input
    format, shows up as NaN advantages)."""
    if torch.isfinite(advantages).all():
        return None
    bad_scores = (~torch.isfinite(scores)).sum().item()
    if bad_scores:
        cause = (f"{bad_scores} of {len(scores)} scores are non-finite: the reward model probably received the wrong "
                 "input format (chat template on/off, response_key, tokenizer) — run `phaserl doctor CONFIG`")
    elif values is not None and not torch.isfinite(values).all():
        cause = "the critic's values are non-finite: lower critic.optim.lr or check the critic's init"
    else:
        cause = "scores are finite but the estimator produced NaN/inf (check algorithm settings)"
    return f"non-finite advantages: {cause}"


class ZeroVarianceMonitor:
    """Groups whose rewards are all equal: their group-baseline advantage is exactly 0, so they teach nothing.

    `observe` returns the global share of such groups (logged every step as
    `train/zero_variance_group_frac`) and, for estimators whose baseline is the group (`group_based`),
    warns on rank 0 the first step it is above 0 and the first step it is 1 (the step learns nothing
    from the reward). It keeps only those two flags; they are not checkpointed (a resumed run warns again).
    """

    def __init__(self, estimator_name: str, group_based: bool):
        self.estimator_name, self.group_based = estimator_name, group_based
        self.warned_some = self.warned_all = False

    def observe(self, scores: torch.Tensor, group_ids: torch.Tensor, step: int) -> float:
        informative = group_has_variance(scores, group_ids)  # [B]
        groups = torch.unique(group_ids).numel()
        zero = groups - torch.unique(group_ids[informative]).numel()
        zero, groups = all_reduce_sum(torch.tensor([float(zero), float(groups)], dtype=torch.float64)).tolist()
        frac = zero / max(groups, 1.0)
        if self.group_based and rank_and_world()[0] == 0:
            every = frac == 1.0 and not self.warned_all
            if (frac > 0 and not self.warned_some) or every:
                what = "every group" if frac == 1.0 else f"{zero:.0f} of {groups:.0f} groups ({100 * frac:.1f}%)"
                log.warning(f"step {step}: {what} scored all rollout.n responses alike, so their "
                            f"{self.estimator_name} advantages are 0 and they add nothing to the update. Turn on "
                            "algorithm.dynamic_sampling (DAPO), raise rollout.n, or make the reward less "
                            "all-or-nothing (train/zero_variance_group_frac is logged every step)")
                self.warned_some, self.warned_all = True, self.warned_all or frac == 1.0
        return frac
