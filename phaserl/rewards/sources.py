"""The score phase's sources: rule functions and/or a reward model turn responses into one score each.

The sources are fixed when the run is built (`phaserl.resolve.build_reward_sources`); `score` returns
the weighted total and each source's raw scores (logged as `reward/<name>`). The reward model is any
object with `score(prompts, responses) -> [B]` (`phaserl.roles.RewardModelWrapper`); this module does
not load it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from phaserl.batch import RolloutBatch, Scores
from phaserl.errors import RewardError
from phaserl.rewards.registry import RuleRewards


class ResponseScorer(Protocol):
    """What the score phase needs of a reward model (phaserl.roles.RewardModelWrapper is one)."""

    def score(self, prompts: list[str], responses: list[str]) -> torch.Tensor:  # [B]
        ...


@dataclass
class RewardSources:
    rules: Optional[RuleRewards] = None
    reward_model: Optional[ResponseScorer] = None
    reward_model_weight: float = 1.0

    def __post_init__(self):
        if self.rules is None and self.reward_model is None:
            raise RewardError("no reward source: configure reward.functions and/or reward_model.enable")

    def score(self, batch: RolloutBatch) -> Scores:
        return self.score_texts(batch.prompts, batch.response_texts, batch.rows, device=batch.input_ids.device)

    def score_texts(self, prompts: list, responses: list, rows: list, *, device) -> Scores:
        B = len(responses)
        total = torch.zeros(B, dtype=torch.float32)
        by_source = {}
        if self.rules is not None:
            records = [dict(row.raw, __source__=row.source) for row in rows]
            rule_total, per_fn = self.rules.score(prompts, responses, [row.ground_truth for row in rows], records)
            total += torch.tensor(rule_total, dtype=torch.float32)
            by_source.update({name: torch.tensor(v, dtype=torch.float32) for name, v in per_fn.items()})
        if self.reward_model is not None:
            rm_scores = self.reward_model.score(prompts, responses).float().cpu()  # [B]
            total += self.reward_model_weight * rm_scores
            by_source["reward_model"] = rm_scores
        return Scores(total=total.to(device), by_source={k: v.to(device) for k, v in by_source.items()})
