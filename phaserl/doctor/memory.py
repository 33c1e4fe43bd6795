"""The doctor's memory report: the per-phase batch sizes that fit this machine, and whether the configured ones do.

Classic mistake 4 is one batch size for every phase. Each phase has its own memory shape, so each gets
its own size: rollout holds a KV cache per sequence, scoring runs the reward model forward-only, and
the update keeps activations per token for backward. With the library's budget (phaserl/memory/budget.py:
model shapes in bytes, the same count the run's builder plans with) this module suggests `rollout.batch_size`,
the scoring size (`reward_model.micro_batch_tokens` when the RM runs on phaserl's decoder,
`reward_model.batch_size` through transformers) and `ppo.micro_batch_tokens` that fit the free memory of the
device, and judges the configured ones: "fits / does not fit / leaves the GPU idle".
Not here: the formulas (memory/budget.py), the memory plan (memory/plan.py), reading the config or loading
models (`probes.py` does that and calls these functions).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..memory.budget import (
    HEADROOM,
    LOGPROB_CHUNK,
    ModelShape,
    fmt_bytes,
    logprob_chunk_bytes,
    scoring_bytes_per_sequence,
    scoring_bytes_per_token,
    train_bytes_per_token,
)
from ..memory.budget import rollout_bytes_per_sequence as _sequence_bytes
from ..memory.plan import Asked, MemoryPlan, PlanFacts, choose_plan

IDLE_FRACTION = 0.25     # a configured size under a quarter of what fits leaves the GPU mostly idle


@dataclass(frozen=True)
class PhaseSizes:
    """The configured sizes and the most each phase can use on one rank (more is never needed)."""

    n: int                       # rollout.n
    prompt_tokens: int           # data.max_prompt_length
    sequence_tokens: int         # prompt + response, at most
    rollout_batch_size: int      # prompts per generate call (configured)
    prompts_per_rank: int        # rollout's cap
    rm_engine: str               # phaserl | transformers: what the RM was loaded as
    rm_batch_size: int           # sequences per scoring call (configured; transformers engine)
    rm_micro_batch_tokens: int   # tokens per scoring forward (configured; phaserl engine)
    rm_packed: bool              # phaserl engine: micro-batches packed without padding
    rm_max_length: int
    responses_per_rank: int      # scoring's cap
    micro_batch_tokens: int      # configured, or as auto chooses it here (doctor/probes.py)
    mini_batch_per_rank: int     # the update's cap, in sequences
    gradient_checkpointing: bool
    routing_replay: bool = False  # actor.routing_replay: the engine also records each position's experts
    compiled: bool = False        # the actor's decoder layers run through torch.compile (actor.compile as chosen)
    checkpoint_layers: Optional[int] = None  # layers recomputed in backward as the memory plan chose (None: the switch)
    offload_activations: bool = False        # their inputs in host memory (actor.offload_activations, as planned)


@dataclass(frozen=True)
class Suggestion:
    key: str          # the config key
    configured: int
    fits: int         # the largest value that fits (capped at what the phase can use)
    cap: int          # what the phase can use at most, in the key's units
    per_item: int     # bytes per unit of the key (per prompt / sequence / token)
    whole: int = 0    # token budgets: tokens of one full-length sequence, the smallest forward (0: a count)

def plan_for(shape: ModelShape, sizes: PhaseSizes, roles: dict, asked: Asked, *, free_bytes: int, device_type: str,
             world_size: int, kept: int, layer_share: float, selective: bool,
             kv_fraction: float, trained_dtype: str = "") -> tuple[PlanFacts, MemoryPlan]:
    """The memory plan a run of these sizes would choose (memory/plan.py, the builder's rule) from the doctor's
    per-role count (`roles`: name -> budget.RoleMemory); `layer_share` is the share of a model's weights in its
    decoder layers (what streaming the reference moves), `kept` what a kept engine would hold, `trained_dtype` the
    dtype of the actor's trained weights (PlanFacts.trained_dtype). Returns the facts and the plan."""
    actor, ref = roles["actor"], roles.get("ref")
    other = sum(m.params + m.optimizer for name, m in roles.items() if name not in ("actor", "ref"))
    facts = PlanFacts(
        shape=shape, device_type=device_type, budget_bytes=free_bytes, actor_params=actor.params,
        actor_trainable=actor.grads, ref_bytes=ref.params if ref else 0,
        ref_layer_bytes=int(ref.params * layer_share) if ref else 0, other_bytes=other, kept_bytes=kept,
        sequence_tokens=sizes.sequence_tokens, mini_batch_sequences=sizes.mini_batch_per_rank,
        compiled=sizes.compiled, world_size=world_size, selective=selective, kv_fraction=kv_fraction,
        sequences_per_call=sizes.rollout_batch_size * sizes.n, routes=sizes.routing_replay,
        trained_dtype=trained_dtype)
    return facts, choose_plan(facts, asked)


def rollout_bytes_per_sequence(shape: ModelShape, sizes: PhaseSizes) -> int:
    """One sequence of this run's rollout phase (memory.budget.rollout_bytes_per_sequence at its sizes)."""
    return _sequence_bytes(shape, prompt_tokens=sizes.prompt_tokens, sequence_tokens=sizes.sequence_tokens,
                           routes=sizes.routing_replay)


def _largest_micro_batch(budget: int, shape: ModelShape, per_token: int, sizes: PhaseSizes) -> int:
    """Whole sequences per update micro-batch that fit `budget` (activations + the log-prob chunk)."""
    T, chunk_per_token = sizes.sequence_tokens, logprob_chunk_bytes(shape, 1)
    small = _largest(budget, T * (per_token + chunk_per_token), sizes.mini_batch_per_rank)
    if small * T < LOGPROB_CHUNK:  # the chunk grows with the micro-batch up to LOGPROB_CHUNK tokens
        return small
    return _largest(budget - logprob_chunk_bytes(shape, LOGPROB_CHUNK), T * per_token, sizes.mini_batch_per_rank)


def _largest(budget: int, per_item: int, cap: int) -> int:
    """How many items of `per_item` bytes fit in `budget`, between 0 and `cap`."""
    if budget <= 0:
        return 0
    return min(cap, budget // max(per_item, 1))


def suggest_sizes(policy: ModelShape, rm: ModelShape | None, sizes: PhaseSizes, *, resident: int,
                  update_extra: int, free_bytes: int) -> list[Suggestion]:
    """For each phase, the largest size that fits `free_bytes` × HEADROOM after the `resident` roles.

    `update_extra` is what the update phase adds to the resident state (the actor's gradients, and a kept
    rollout engine's KV cache and weight copies).
    A `fits` of 0 means not even one item fits.
    """
    usable = int(free_bytes * HEADROOM)
    out = []
    per_prompt = sizes.n * rollout_bytes_per_sequence(policy, sizes)
    out.append(Suggestion("rollout.batch_size", sizes.rollout_batch_size,
                          _largest(usable - resident, per_prompt, sizes.prompts_per_rank),
                          sizes.prompts_per_rank, per_prompt))
    if rm is not None and sizes.rm_engine == "phaserl":
        out.append(_scoring_tokens(rm, sizes, usable - resident))
    elif rm is not None:
        per_seq = scoring_bytes_per_sequence(rm, sizes.rm_max_length)
        out.append(Suggestion("reward_model.batch_size", sizes.rm_batch_size,
                              _largest(usable - resident, per_seq, sizes.responses_per_rank),
                              sizes.responses_per_rank, per_seq))
    per_token = train_bytes_per_token(policy, sizes.gradient_checkpointing, sizes.compiled, sizes.sequence_tokens,
                                      checkpoint_layers=sizes.checkpoint_layers,
                                      offload_activations=sizes.offload_activations)
    seqs = _largest_micro_batch(usable - resident - update_extra, policy, per_token, sizes)
    out.append(Suggestion("ppo.micro_batch_tokens", sizes.micro_batch_tokens, seqs * sizes.sequence_tokens,
                          sizes.mini_batch_per_rank * sizes.sequence_tokens, per_token, whole=sizes.sequence_tokens))
    return out


def _scoring_tokens(rm: ModelShape, sizes: PhaseSizes, budget: int) -> Suggestion:
    """reward_model.micro_batch_tokens that fit `budget`: any token count from one full-length input
    (max_length tokens, always scored even when the budget is smaller) up to all of a rank's responses."""
    M = sizes.rm_max_length
    per_token = scoring_bytes_per_token(rm, M, sizes.rm_packed)
    fits = _largest(budget, per_token, sizes.responses_per_rank * M)
    return Suggestion("reward_model.micro_batch_tokens", sizes.rm_micro_batch_tokens, fits if fits >= M else 0,
                      sizes.responses_per_rank * M, per_token, whole=M)


def effective(s: Suggestion, sizes: PhaseSizes) -> int:
    """What the configured value actually uses: never more than the phase's cap; for a token budget, the
    full-length sequences it holds (at least one: a longer one is run alone)."""
    if s.whole:
        return max(1, min(s.configured, s.cap) // s.whole) * s.whole
    return min(s.configured, s.cap)


def judge(s: Suggestion, sizes: PhaseSizes, *, device_type: str) -> str:
    """'' when the configured size is sensible; else why not (does not fit / leaves the GPU idle)."""
    used = effective(s, sizes)
    if used > s.fits:
        return (f"{s.key} = {s.configured} likely does not fit: its phase needs ~{fmt_bytes(used * s.per_item)} "
                f"on top of the weights; {s.fits} fit")
    if device_type == "cuda" and used < s.cap and used <= IDLE_FRACTION * s.fits:
        return (f"{s.key} = {s.configured} uses under {IDLE_FRACTION:.0%} of what fits ({s.fits}): the GPU "
                f"stays mostly idle in that phase")
    return ""


def ceil_div(a: int, b: int) -> int:
    return math.ceil(a / b)
