"""Phase 5 (advantage): scores → token rewards (optionally minus KL) → advantages and returns.

The estimator and the KL placement are chosen when the run is built (`AdvantageSettings`); this
module only applies them, and names the likely cause when advantages come out non-finite.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..algo import AdvantageInputs, apply_kl_to_rewards
from ..batch import RolloutBatch
from ..parallel import all_reduce_sum, is_distributed


@dataclass(frozen=True)
class AdvantageSettings:
    estimator: Callable          # algo.ADVANTAGE_ESTIMATORS[name]
    gamma: float
    lam: float
    norm_by_std: bool
    kl_in_reward: bool
    kl_estimator: str


def place_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Put each response's score on its last real token.  scores [B] → token rewards [B, R]"""
    token_rewards = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    last = (response_mask.sum(dim=1) - 1).clamp(min=0).long()             # [B]
    token_rewards[torch.arange(len(scores), device=scores.device), last] = scores.float()
    return token_rewards * response_mask


def compute_advantages(batch: RolloutBatch, scores: torch.Tensor, s: AdvantageSettings, *,
                       old_logprobs: torch.Tensor, ref_logprobs: Optional[torch.Tensor],
                       values: Optional[torch.Tensor], kl_coef: float,
                       baseline_scores: Optional[torch.Tensor] = None) -> tuple:
    """Returns (advantages [B, R], returns [B, R], token_rewards [B, R], kl [B, R] or None)."""
    mask = batch.response_mask.float()                                       # [B, R]
    token_rewards = place_scores(scores, mask)                               # [B, R]
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
