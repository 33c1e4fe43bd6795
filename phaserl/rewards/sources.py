"""The score phase's sources: rule functions and/or a reward model turn responses into one score each.

The sources are fixed when the run is built (`phaserl.resolve.build_reward_sources`); `score` returns
the weighted total and each source's raw scores (logged as `reward/<name>`). The reward model is any
object with `score(prompts, responses) -> [B]` (`phaserl.roles.RewardModelWrapper`); this module does
not load it.

Scoring as responses complete: `submit(prompts, responses, rows)` (e.g. one group of n) starts the rule
functions on the reward workers and returns at once; `collect([pending, ...])` waits for them, runs the
reward model once over all the pending rows, so that its micro-batches stay full, and returns one Scores for
them in the order given. Collecting each group on its own works too (the reward model's scores do not depend
on which rows share a call), but with a reward model sharded over ranks every rank must make the same number
of calls. `score(batch)` is `collect([submit(batch)])`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from phaserl.batch import RolloutBatch, Scores
from phaserl.errors import RewardError
from phaserl.rewards.registry import RuleRewards, RuleScoring


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
        return self.collect([self.submit(prompts, responses, rows)], device=device)

    def submit(self, prompts: list, responses: list, rows: list) -> "PendingScores":
        """Start the rule functions on these responses (`rows`: their PromptRows) and return at once."""
        rules = None
        if self.rules is not None:
            records = [dict(row.raw, __source__=row.source) for row in rows]
            rules = self.rules.submit(prompts, responses, [row.ground_truth for row in rows], records)
        return PendingScores(list(prompts), list(responses), rules)

    def collect(self, pending: list["PendingScores"], *, device) -> Scores:
        """The Scores of the pending responses, one after another in the order given: the rule results (waiting
        for the workers), then the reward model's scores from one call over all of them."""
        responses = [r for item in pending for r in item.responses]
        B = len(responses)
        total = torch.zeros(B, dtype=torch.float32)
        by_source = {}
        if self.rules is not None:
            results = [item.rules.result() for item in pending]
            total += torch.tensor([t for rule_total, _ in results for t in rule_total], dtype=torch.float32)
            for name in (results[0][1] if results else {}):
                by_source[name] = torch.tensor([v for _, per_fn in results for v in per_fn[name]], dtype=torch.float32)
        if self.reward_model is not None:
            prompts = [p for item in pending for p in item.prompts]
            rm_scores = self.reward_model.score(prompts, responses).float().cpu()  # [B]
            total += self.reward_model_weight * rm_scores
            by_source["reward_model"] = rm_scores
        return Scores(total=total.to(device), by_source={k: v.to(device) for k, v in by_source.items()})

    def close(self) -> None:
        """Stop the rule functions' worker processes, if any (the end of a run)."""
        if self.rules is not None:
            self.rules.close()


@dataclass
class PendingScores:
    """One `RewardSources.submit`: the texts for the reward model and the rule functions' running scores."""

    prompts: list
    responses: list
    rules: Optional[RuleScoring] = None

    def done(self) -> bool:
        """True when collecting it waits for no rule worker (the reward model still runs in `collect`)."""
        return self.rules is None or self.rules.done()
