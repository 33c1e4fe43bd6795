"""Choosing the next token: temperature, top-k, top-p (nucleus) and greedy, as pure functions.

The log-prob returned with each token is log_softmax(logits / T) over the FULL vocabulary, taken before
top-k/top-p filtering (T = 1 for greedy). That is the quantity the trainer recomputes from the policy
(it knows the temperature but does not re-apply the filters), so rollout and training log-probs agree
and the PPO ratio starts at exactly 1. Filtering only decides which token is drawn.
The rollout engine's noise is keyed (`keyed_noise`): the Exp(1) noise of the draw after position p of a
sequence is a function of (the call's seed, the sequence's key, p, the vocabulary index) alone, so a
sequence samples the same tokens whatever slot, batch or decode step it is drawn in (counter-based:
splitmix64 in int64 torch ops, no generator state, capturable in CUDA graphs).
Not here: the decode loop (generate.py), repetition penalties, beam search.

Legend: B batch rows, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from phaserl.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int                      # tokens per response, at most
    temperature: float = 1.0                 # 0 = greedy (argmax)
    top_p: float = 1.0                       # keep the smallest set of tokens with this much mass (1 = off)
    top_k: int = 0                           # keep the k most likely tokens (0 = off)
    stop_token_ids: tuple[int, ...] = ()     # end a response like EOS does (the stop token is kept)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ConfigError(f"SamplingParams.max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.temperature < 0:
            raise ConfigError(f"SamplingParams.temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"SamplingParams.top_p={self.top_p}: must be in (0, 1] (1 = off)")
        if self.top_k < 0:
            raise ConfigError(f"SamplingParams.top_k={self.top_k}: must be >= 0 (0 = off)")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _int64(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return c - (1 << 64) if c >= 1 << 63 else c


GAMMA = _int64(0x9E3779B97F4A7C15)  # splitmix64's increment (2^64 / golden ratio)
MIX1, MIX2 = _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)  # its finalizer's multipliers
UNIFORM_BITS = 23  # (bits + 0.5) * 2^-23 is exact in float32 and lies in (0, 1): E = -log(u) is finite and > 0


def shift_right(x, s: int):
    """Logical right shift of int64 x (torch's >> is arithmetic: the sign bit would fill the top)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x):
    """splitmix64's finalizer: a bijection of 64-bit words that scatters every input bit over the output.
    int64 tensors (or Triton int64 scalars): the multiplications wrap modulo 2^64 as the unsigned ones do."""
    x = (x ^ shift_right(x, 30)) * MIX1
    x = (x ^ shift_right(x, 27)) * MIX2
    return x ^ shift_right(x, 31)


def row_states(seed: torch.Tensor, keys: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """seed [1] (or a scalar), keys [B], at [B] int64 -> [B] int64: one word per (seed, key, position).
    kernels._row_seed computes the same word in the sampling kernel."""
    return mix64(mix64(mix64(seed) + keys) + at)


def keyed_noise(seed: torch.Tensor, keys: torch.Tensor, at: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [B, V] float32 for the draws after positions `at` [B] of the sequences keyed `keys` [B].

    Element (b, v) is splitmix64's output number v + 1 of the stream that row_states(seed, key, at) starts:
    u = (its top 23 bits + 0.5) / 2^23, E = -log(u). Rows with equal (key, at) get equal noise; any other
    two rows are independent streams. No generator state: the same call gives the same noise anywhere.
    """
    steps = torch.arange(1, vocab + 1, device=keys.device, dtype=torch.long) * GAMMA  # [V], wraps
    bits = shift_right(mix64(row_states(seed, keys, at)[:, None] + steps), 64 - UNIFORM_BITS)  # [B, V]
    return -torch.log((bits.float() + 0.5) * 2.0 ** -UNIFORM_BITS)


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits [B, V] with everything below the k-th largest per row set to -inf (k = 0: unchanged)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth_largest = logits.topk(k, dim=-1).values[:, -1:]  # [B, 1]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """logits [B, V] keeping, per row, the most likely tokens until their mass reaches p (p = 1: unchanged).

    A token is kept when the mass of the tokens ranked strictly above it is below p, so the most
    likely token always survives and p -> 0 becomes greedy.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs  # [B, V]
    drop_sorted = mass_above >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def sample_next(logits: torch.Tensor, params: SamplingParams,
                generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B] int64, logprobs [B] float32 under log_softmax(logits / T)).

    `generator` must live on the logits' device.
    """
    logits = logits.float()
    temperature = 1.0 if params.greedy else params.temperature
    scaled = logits / temperature  # [B, V]
    logprobs = scaled.log_softmax(dim=-1)  # [B, V], unfiltered: what the trainer recomputes
    if params.greedy:
        tokens = logits.argmax(dim=-1)  # [B]
    else:
        kept = filter_top_p(filter_top_k(scaled, params.top_k), params.top_p)
        tokens = torch.multinomial(kept.softmax(dim=-1), 1, generator=generator).squeeze(-1)  # [B]
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)
