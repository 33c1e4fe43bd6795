"""The memory plan: which memory measures a run takes so that its step fits the card, chosen cheapest first.

When the budget (budget.py) says the step does not fit this process's device memory, the plan adds measures one
at a time, cheapest first, until it does; each measure is a config key that `null`/`auto` leaves to the plan and a
value sets by hand (the plan then works around it):

  1. ref.stream_weights      the reference policy's decoder layers stay in CPU memory and come to the GPU one layer
                             ahead of its forward-only pass (roles/streaming.py). Saves the reference's layer
                             weights; costs their copy over PCIe once per pass, overlapped with the previous layer's
                             compute.
  2. actor.checkpoint_layers activation checkpointing, selective: the fewest of the actor's layers whose activations
                             are recomputed in backward (each keeps only its input). Saves most of those layers'
                             activations; costs their forward once more in backward (k / layers of the forward).
  3. actor.offload_activations  taken only when checkpointing the layers is not enough: the checkpointed layers'
                             inputs go to pinned host memory during forward and come back ahead of backward, at most
                             budget.OFFLOAD_IN_FLIGHT on the device at once (roles/activation_offload.py). Saves
                             (k - OFFLOAD_IN_FLIGHT) x h x b per token; costs each input's copy both ways, overlapped
                             with the layers' compute, so it comes before the optimizer's CPU step, which the GPU
                             waits for.
  4. actor.optimizer_offload AdamW's moments and step on the CPU (roles/optim.py): saves twice the trainable weights;
                             costs the gradients' copy down, the CPU step and the weights' copy up, per optimizer step,
                             bucket by bucket overlapped. Not taken for float16 weights: their AdamW steps float32
                             masters on the device (roles/loss_scale.py), which the offloaded step does not hold.
  5. ppo.micro_batch_tokens  smaller micro-batches (config/auto.micro_batch_rule on the plan's count), down to one
                             sequence: costs the host's fixed work per micro-batch.
  6. the KV budget           rollout.engine_memory_fraction of what rollout mode leaves free holds the KV cache; the
                             engine decodes as many sequences at once as it holds and the rest wait for a slot
                             (reported here as the sequences it holds; fewer than one is the only failure).
"Fits" is the micro-batch rule's test: the update's peak with a micro-batch of PLAN_TARGET_TOKENS (or the whole
mini-batch, or one sequence, whichever is in between) stays within the fixed state plus the share of the rest that
the rule gives activations. Speed costs are stated as what they do; their measured seconds are in docs/memory.md.
Not here: the byte counts (budget.py), gathering the facts from a loaded run (trainer/speed.py) or a config (the
doctor), applying the choices (trainer/build.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ..config.auto import Choice, choose, micro_batch_rule, update_room
from .budget import (
    GB,
    OFFLOAD_IN_FLIGHT,
    ModelShape,
    adamw_state_bytes,
    fmt_bytes,
    kv_cache_bytes_per_sequence,
    update_peak_bytes,
)

PLAN_TARGET_TOKENS = 4096  # a micro-batch at least this long keeps the host's per-micro-batch work small beside its
                           # compute; below it the plan checkpoints layers rather than shrinking the micro-batch


@dataclass(frozen=True)
class PlanFacts:
    """What the plan decides from: the actor's shape and what each role holds on this rank's device, in bytes."""

    shape: ModelShape
    device_type: str
    budget_bytes: int          # the device memory this process can have (free + what it holds already)
    actor_params: int          # the actor's weights on the device
    actor_trainable: int       # of which train: gradients of the same size, AdamW's state budget.adamw_state_bytes
    ref_bytes: int = 0         # a separate reference policy's weights on the device (0: none, or the LoRA base)
    ref_layer_bytes: int = 0   # of which in its decoder layers: what streaming takes off the device
    other_bytes: int = 0       # the critic (weights, gradients, AdamW) and the reward model: resident, not planned
    kept_bytes: int = 0        # a kept rollout engine (rollout.engine_keep_awake) through the update
    sequence_tokens: int = 1   # prompt + response, at most
    mini_batch_sequences: int = 1  # an optimizer step's sequences on this rank
    compiled: bool = False     # the actor's layers run compiled (their activation count)
    world_size: int = 1
    selective: bool = True     # the actor's decoder recomputes any number of layers (phaserl's); else all or none
    kv_fraction: float = 0.4   # rollout.engine_memory_fraction
    sequences_per_call: int = 1  # what one generate call would decode at once (rollout.batch_size x rollout.n)
    routes: bool = False       # actor.routing_replay: the engine records experts per token
    trained_dtype: str = ""    # the actor's trained weights' dtype: float16 keeps float32 masters (6 x actor_trainable
                               # of AdamW state) on the device; any other, two moments in it (2 x)


@dataclass(frozen=True)
class Asked:
    """The plan's keys as the config sets them (None = auto: the plan decides)."""

    stream_reference: Optional[bool] = None    # ref.stream_weights
    checkpoint_layers: Optional[int] = None    # actor.checkpoint_layers (actor.gradient_checkpointing: all)
    optimizer_offload: Optional[bool] = None   # actor.optimizer_offload
    micro_batch_tokens: Optional[int] = None   # ppo.micro_batch_tokens
    offload_activations: Optional[bool] = None  # actor.offload_activations


@dataclass(frozen=True)
class Measures:
    """What the plan takes: the reference streamed, k layers checkpointed, AdamW on the CPU, the checkpointed
    layers' inputs in host memory."""

    stream: bool = False
    layers: int = 0
    offload: bool = False
    activations: bool = False


@dataclass(frozen=True)
class MemoryPlan:
    """The measures chosen for this run, each with why, and what the budget predicts under them."""

    stream_reference: Choice
    checkpoint_layers: Choice
    optimizer_offload: Choice
    micro_batch_tokens: Choice
    measures: Measures
    peak_bytes: int            # the update's predicted peak on this rank
    budget_bytes: int
    kv_sequences: int          # sequences the rollout KV budget holds at once (-1: not counted, off CUDA)
    problem: str = ""          # '' when the plan fits; else what does not, even with every measure
    offload_activations: Optional[Choice] = None  # None only where nothing is planned (an unknown shape)

    def all(self) -> list[Choice]:
        return [c for c in (self.stream_reference, self.checkpoint_layers, self.offload_activations,
                            self.optimizer_offload, self.micro_batch_tokens) if c is not None]

    @property
    def fits(self) -> bool:
        return not self.problem

    def overrides(self) -> list[str]:
        """The plan as `key=value` settings (to pin it, or to try a tighter one after an out-of-memory stop)."""
        return [f"{c.key}={str(c.value).lower() if isinstance(c.value, bool) else c.value}" for c in self.all()]

    def summary(self) -> str:
        measures = [words for words, on in (("reference streamed", self.stream_reference.value),
                                            (f"{self.checkpoint_layers.value} layer(s) checkpointed",
                                             self.checkpoint_layers.value),
                                            ("their inputs in host memory", self.measures.activations),
                                            ("optimizer state on the CPU", self.optimizer_offload.value)) if on]
        where = "everything on the device" if self.kv_sequences >= 0 else "nothing planned off CUDA"
        kv = "" if self.kv_sequences < 0 else f"; rollout holds {self.kv_sequences} sequence(s) at once"
        return (f"memory plan: {', '.join(measures) or where}; micro-batch {self.micro_batch_tokens.value} tokens; "
                f"predicted update peak {fmt_bytes(self.peak_bytes)} of {fmt_bytes(self.budget_bytes)}{kv}")


def asked_from_config(cfg, num_layers: int) -> Asked:
    """The plan's keys as a Config sets them (actor.gradient_checkpointing: true means every layer)."""
    a = cfg.actor
    layers = num_layers if a.gradient_checkpointing else a.checkpoint_layers
    return Asked(stream_reference=cfg.ref.stream_weights, checkpoint_layers=layers,
                 optimizer_offload=a.optimizer_offload, micro_batch_tokens=cfg.ppo.micro_batch_tokens,
                 offload_activations=a.offload_activations)


def fixed_bytes(f: PlanFacts, s: Measures) -> int:
    """What the update holds whatever the micro-batch: weights, gradients, AdamW (unless offloaded), the reference
    (its layers unless streamed: then the two layers in flight), the other roles and a kept engine."""
    ref = f.ref_bytes
    if s.stream and f.ref_bytes:
        layers = max(1, f.shape.num_layers)
        ref = f.ref_bytes - f.ref_layer_bytes + 2 * f.ref_layer_bytes // layers
    optimizer = 0 if s.offload else adamw_state_bytes(f.actor_trainable, f.trained_dtype)
    return f.actor_params + f.actor_trainable + optimizer + ref + f.other_bytes + f.kept_bytes


def saved_bytes(f: PlanFacts, s: Measures) -> int:
    """What the measures take off the device's fixed state (the streamed reference's layers, AdamW's moments)."""
    return fixed_bytes(f, Measures()) - fixed_bytes(f, s)


def peak_bytes(f: PlanFacts, s: Measures, tokens: int) -> int:
    """The update's peak with a micro-batch of `tokens` under state `s` (budget.update_peak_bytes)."""
    grads = f.actor_trainable
    return update_peak_bytes(f.shape, resident=fixed_bytes(f, s) - grads, grads=grads, micro_batch_tokens=tokens,
                             gradient_checkpointing=False, compiled=f.compiled, sequence_tokens=f.sequence_tokens,
                             checkpoint_layers=s.layers, offload_activations=s.activations)


def target_tokens(f: PlanFacts) -> int:
    """The micro-batch the plan wants room for: PLAN_TARGET_TOKENS of whole sequences, within the mini-batch."""
    T = f.sequence_tokens
    whole = -(-PLAN_TARGET_TOKENS // T) * T
    return max(T, min(whole, f.mini_batch_sequences * T))


def _fits(f: PlanFacts, s: Measures) -> bool:
    return peak_bytes(f, s, target_tokens(f)) <= update_room(fixed_bytes(f, s), f.budget_bytes)


def _fewest_layers(f: PlanFacts, s: Measures) -> int:
    """The fewest checkpointed layers with which the target micro-batch fits (all of them when none do)."""
    L = f.shape.num_layers
    if not f.selective:
        return 0 if _fits(f, s) else L
    lo, hi = 0, L
    while lo < hi:  # the peak falls as layers are checkpointed
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _fits(f, dataclasses.replace(s, layers=mid)) else (mid + 1, hi)
    return lo


def kv_sequences(f: PlanFacts, s: Measures) -> int:
    """Sequences the engine's KV pool holds at once in rollout mode: rollout.engine_memory_fraction of what the
    weights, AdamW (unless offloaded) and the reference (unless streamed) leave, over one sequence's slot."""
    rollout_fixed = fixed_bytes(f, s) - f.actor_trainable - f.kept_bytes  # no gradients outside the update
    per_sequence = kv_cache_bytes_per_sequence(f.shape, f.sequence_tokens, routes=f.routes)
    pool = f.kv_fraction * max(0, f.budget_bytes - rollout_fixed)
    return int(pool // max(1, per_sequence))


def choose_plan(f: PlanFacts, asked: Asked = Asked()) -> MemoryPlan:
    """The plan for facts `f`: measures set in `asked` are kept, the auto ones added cheapest first until the
    target micro-batch fits; then the micro-batch rule picks the largest micro-batch the chosen state leaves room
    for."""
    L = f.shape.num_layers
    blocked = _blocked(f)
    s = Measures(stream=bool(asked.stream_reference), layers=asked.checkpoint_layers or 0,
                 offload=bool(asked.optimizer_offload),
                 activations=bool(asked.offload_activations) and not blocked["activations"])
    s = dataclasses.replace(s, layers=min(s.layers, L))
    why = {"stream": "", "layers": "", "offload": "", "activations": ""}
    if f.device_type == "cuda" and not _fits(f, s):
        if asked.stream_reference is None and not blocked["stream"]:
            s = dataclasses.replace(s, stream=True)
            why["stream"] = (f"frees {saved_bytes(f, s) / GB:.1f} GiB of reference layers, copied one layer ahead of "
                             "its forward")
        if asked.checkpoint_layers is None and not _fits(f, s):
            s = dataclasses.replace(s, layers=_fewest_layers(f, s))
        if asked.offload_activations is None and not blocked["activations"] and s.layers and not _fits(f, s):
            s = dataclasses.replace(s, activations=True)
            if asked.checkpoint_layers is None:  # the last layer kept costs what one recomputed layer holds anyway
                s = dataclasses.replace(s, layers=_fewest_layers(f, dataclasses.replace(s, layers=0)))
        if asked.optimizer_offload is None and not blocked["offload"] and not _fits(f, s):
            s = dataclasses.replace(s, offload=True)
            freed = adamw_state_bytes(f.actor_trainable, f.trained_dtype)
            why["offload"] = f"frees {freed / GB:.1f} GiB of AdamW moments (the step runs on the CPU)"
            s = _after_optimizer_offload(f, s, asked)
        if s.activations and asked.offload_activations is None:
            why["activations"] = _offload_words(f, s)
        if s.layers:
            why["layers"] = (f"{s.layers} of {L} layers recompute their activations in backward: " + (
                f"the smallest number that leaves room for a {target_tokens(f)}-token micro-batch" if _fits(f, s)
                else "all of them, and the micro-batch is still smaller than the plan aims for"))
    micro = choose("ppo.micro_batch_tokens", asked.micro_batch_tokens, micro_batch_rule(
        device_type=f.device_type, sequence_tokens=f.sequence_tokens, mini_batch_sequences=f.mini_batch_sequences,
        fixed_bytes=fixed_bytes(f, s), budget_bytes=f.budget_bytes, peak_of=lambda tokens: peak_bytes(f, s, tokens)))
    tokens = min(micro.value, f.mini_batch_sequences * f.sequence_tokens)
    peak = peak_bytes(f, s, tokens)
    kv = kv_sequences(f, s) if f.device_type == "cuda" else -1
    return MemoryPlan(
        stream_reference=choose("ref.stream_weights", asked.stream_reference,
                                (s.stream, why["stream"] or _keep_words(f, blocked["stream"], "the reference"))),
        checkpoint_layers=choose("actor.checkpoint_layers", asked.checkpoint_layers,
                                 (s.layers, why["layers"] or _keep_words(f, "", "every layer's activations"))),
        optimizer_offload=choose("actor.optimizer_offload", asked.optimizer_offload,
                                 (s.offload, why["offload"] or _keep_words(f, blocked["offload"], "AdamW's moments"))),
        micro_batch_tokens=micro, measures=s, peak_bytes=peak, budget_bytes=f.budget_bytes, kv_sequences=kv,
        problem=_problem(f, peak, kv),
        offload_activations=_activations_choice(f, s, asked, why["activations"] or _keep_words(
            f, blocked["activations"], "the checkpointed layers' inputs")))


def _after_optimizer_offload(f: PlanFacts, s: Measures, asked: Asked) -> Measures:
    """With AdamW's moments gone, fewer checkpointed layers may do, and perhaps without their inputs offloaded:
    the cheapest state that fits (auto keys only)."""
    if asked.checkpoint_layers is None:
        s = dataclasses.replace(s, layers=_fewest_layers(f, dataclasses.replace(s, layers=0)))
    if asked.offload_activations is None and s.activations:
        plain = dataclasses.replace(s, activations=False)
        if asked.checkpoint_layers is None:
            plain = dataclasses.replace(plain, layers=_fewest_layers(f, dataclasses.replace(plain, layers=0)))
        if _fits(f, plain):
            return plain
    return s


def _offload_words(f: PlanFacts, s: Measures) -> str:
    """Why the plan moved the checkpointed layers' inputs to host memory, with what it frees."""
    tokens = target_tokens(f)
    freed = peak_bytes(f, dataclasses.replace(s, activations=False), tokens) - peak_bytes(f, s, tokens)
    return (f"checkpointing alone does not fit the step: the {s.layers} checkpointed layers' inputs go to host memory, "
            f"{OFFLOAD_IN_FLIGHT} on the device at once (frees {freed / GB:.1f} GiB at a {tokens}-token micro-batch); "
            "its copies overlap the layers' compute, so it comes before the optimizer's CPU step")


def _activations_choice(f: PlanFacts, s: Measures, asked: Asked, why: str) -> Choice:
    """actor.offload_activations as chosen; set by hand where it cannot run (or with no layer checkpointed), off
    with the reason."""
    blocked = _blocked(f)["activations"]
    if asked.offload_activations and blocked:
        return Choice("actor.offload_activations", True, False, f"ignored: {blocked}")
    if asked.offload_activations and not s.layers:
        return Choice("actor.offload_activations", True, True, "set in the config, but no layer is checkpointed: "
                                                               "nothing to move")
    return choose("actor.offload_activations", asked.offload_activations, (s.activations, why))


def _blocked(f: PlanFacts) -> dict:
    """Why a measure cannot be taken here ('' when it can)."""
    ranks = f"{f.world_size} ranks: FSDP shards it (ref.fsdp.cpu_offload keeps a sharded reference on the CPU)"
    return {"stream": "no separate reference policy on the device" if not f.ref_bytes else
            ranks if f.world_size > 1 else "",
            "offload": "nothing trains on the device" if not f.actor_trainable else
            "float16 weights: AdamW steps their float32 masters on the device (the CPU step does not run on them)"
            if f.trained_dtype == "float16" else
            f"{f.world_size} ranks: FULL_SHARD spreads AdamW over them" if f.world_size > 1 else "",
            "activations": "" if f.selective else "the transformers path checkpoints through its own code"}


def _keep_words(f: PlanFacts, blocked: str, what: str) -> str:
    if blocked:
        return blocked
    if f.device_type != "cuda":
        return f"{f.device_type.upper()}: the host's memory, nothing planned"
    return f"the step fits with {what} on the device"


def _problem(f: PlanFacts, peak: int, kv: int) -> str:
    if f.device_type != "cuda":
        return ""
    if peak > f.budget_bytes:
        return (f"the update needs ~{fmt_bytes(peak)} with one sequence per micro-batch and every measure the "
                f"config leaves to the plan, more than the {fmt_bytes(f.budget_bytes)} this process has")
    if kv < 1:
        return (f"the rollout KV budget (rollout.engine_memory_fraction={f.kv_fraction}) holds no sequence of "
                f"{f.sequence_tokens} tokens")
    return ""


def tighter_plan(f: PlanFacts, *, predicted_bytes: int, measured_bytes: int) -> MemoryPlan:
    """The plan the budget would choose if the count were off by what a run measured (`measured_bytes` against
    the `predicted_bytes` peak): every key back to auto, the budget scaled down by predicted / measured. Off CUDA
    the same rule on the host's memory, where only checkpointing and smaller micro-batches save anything."""
    scale = min(1.0, predicted_bytes / max(1, measured_bytes)) * 0.9  # and a margin: the run did not fit
    asked = Asked()
    if f.device_type != "cuda":  # weights streamed or stepped "on the CPU" would not leave host memory
        f, asked = dataclasses.replace(f, device_type="cuda"), Asked(stream_reference=False, optimizer_offload=False)
    return choose_plan(dataclasses.replace(f, budget_bytes=int(f.budget_bytes * scale)), asked)
