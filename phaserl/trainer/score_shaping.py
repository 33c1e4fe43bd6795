"""Phase 3's last step: DAPO's overlong shaping of the scores (chosen at build time, like the estimator).

The reward sources (`phaserl.rewards`) score responses; this adds the length-based term that depends
on the rollout settings (rollout.max_new_tokens), so it lives with the loop rather than with the rewards.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..algo import overlong_penalty
from ..batch import RolloutBatch, Scores


@dataclass(frozen=True)
class OverlongShaping:
    """DAPO's soft overlong penalty (algo.reward_shaping), added to the total as source `overlong`."""

    max_len: int      # rollout.max_new_tokens
    buffer: int       # algorithm.overlong_buffer (> 0)
    factor: float     # algorithm.overlong_penalty

    def __call__(self, scores: Scores, batch: RolloutBatch) -> Scores:
        penalty = overlong_penalty(batch.response_lengths(), max_len=self.max_len, buffer=self.buffer,
                                   factor=self.factor).to(scores.total)  # [B]
        return Scores(total=scores.total + penalty, by_source={**scores.by_source, "overlong": penalty})


def no_shaping(scores: Scores, batch: RolloutBatch) -> Scores:
    """algorithm.overlong_buffer = 0: scores as the sources gave them."""
    return scores
