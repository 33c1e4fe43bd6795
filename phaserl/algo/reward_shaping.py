"""DAPO's overlong reward shaping: a soft length penalty over a buffer before the length limit.

DAPO (Yu et al. 2025, arXiv 2503.14476, eq. 13), with L_max = rollout.max_new_tokens and a buffer of
L_cache tokens:
    penalty(L) = 0                                  if L <= L_max - L_cache
               = ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max
               = -1                                 if L > L_max
and the score becomes s + factor * penalty(L). Same as verl's `overlong_buffer` (reward manager).
A response that hit the limit has L = L_max and gets -factor: truncated answers are discouraged
softly instead of being scored as if complete. Pure tensor math.
"""
from __future__ import annotations

from torch import Tensor

from phaserl.errors import ConfigError


def overlong_penalty(lengths: Tensor, *, max_len: int, buffer: int, factor: float) -> Tensor:
    """The score change of each response.  lengths [B] (tokens) -> [B] float32, <= 0."""
    if not 0 < buffer <= max_len:
        raise ConfigError(f"algorithm.overlong_buffer = {buffer} must be in [1, rollout.max_new_tokens = "
                          f"{max_len}] (0 turns the shaping off); DAPO uses a quarter of the limit")
    if factor < 0:
        raise ConfigError(f"algorithm.overlong_penalty must be >= 0, got {factor}")
    start = max_len - buffer
    over = (lengths.float() - start).clamp(min=0) / buffer  # [B] 0 .. 1 inside the buffer
    return -factor * over.clamp(max=1.0)
