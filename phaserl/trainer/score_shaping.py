"""Phase 3's last step: DAPO's overlong shaping of the scores (chosen at build time, like the estimator).

The reward sources (`phaserl.rewards`) score responses; this adds the length-based term that depends
on the rollout settings (rollout.max_new_tokens), so it lives with the loop rather than with the rewards.

Multi-turn episodes (batch.episodes): rollout.max_new_tokens caps one model turn, so the length that
is judged is the episode's last model turn (its sampled ids; the whole response also holds earlier
turns and observation ids, and would be "overlong" in every episode of more than one turn), and the
penalty lands on that turn's final token, next to the turn rewards the scores already place
(Scores.token_rewards); earlier turns keep theirs unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..algo import overlong_penalty
from ..batch import RolloutBatch, Scores
from .episode_batch import turn_ends


@dataclass(frozen=True)
class OverlongShaping:
    """DAPO's soft overlong penalty (algo.reward_shaping), added to the total as source `overlong`."""

    max_len: int      # rollout.max_new_tokens
    buffer: int       # algorithm.overlong_buffer (> 0)
    factor: float     # algorithm.overlong_penalty

    def __call__(self, scores: Scores, batch: RolloutBatch) -> Scores:
        if batch.episodes is None:
            lengths = batch.response_lengths()  # [B]
        else:
            lengths = torch.tensor([last_turn_length(ep) for ep in batch.episodes])  # [B]
        penalty = overlong_penalty(lengths, max_len=self.max_len, buffer=self.buffer,
                                   factor=self.factor).to(scores.total)  # [B]
        placed = scores.token_rewards  # [B, R] or None (then the total lies on the last sampled token)
        if placed is not None:
            columns = [ends[-1] if ends else -1 for ends in map(turn_ends, batch.episodes)]
            rows = [i for i, c in enumerate(columns) if c >= 0]  # an episode without a model turn has no penalty
            placed = placed.clone()
            placed[rows, [columns[i] for i in rows]] += penalty[rows].to(placed)
        return Scores(total=scores.total + penalty, by_source={**scores.by_source, "overlong": penalty},
                      token_rewards=placed)


def last_turn_length(episode) -> int:
    """Sampled ids of the episode's last model turn (0 without one)."""
    model = [s for s in episode.segments[1:] if s.kind == "model"]
    return len(model[-1].token_ids) if model else 0


def no_shaping(scores: Scores, batch: RolloutBatch) -> Scores:
    """algorithm.overlong_buffer = 0: scores as the sources gave them."""
    return scores
