"""The speed settings that depend on the machine, chosen once when the run is built, and the block that says
which were chosen and why.

`choose_speed(cfg, roles, derived, world_size)` gathers the facts (device, Triton, which models are phaserl's
decoder and how big, world size, and for `rollout.engine_keep_awake` and `ppo.micro_batch_tokens` the memory
budget's count of the update (`UpdateCount`) against this process's device memory) and applies `config/auto.py`'s
rule to every setting left at auto (null); true / false (a number) in the config win. The builder applies the
choices and keeps them in `RunSettings.speed`; the run summary prints one line per choice (`Choice.line()`):

    auto       actor.compile=auto -> on: CUDA, phaserl's decoder, Triton
               rollout.engine_keep_awake=auto -> on: 24.3 GiB needed of 139 GiB
               ...

Not here: the rules (config/auto.py), the memory formulas (memory/budget.py), torch's compile caches
(compile_cache.py), `ppo.packing`'s per-role choice (build.set_packing: it is reported here as made).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from ..compile_cache import CompileWatch, enable_compile_cache
from ..config.auto import (
    MICRO_BATCH_OFF_CUDA,
    Choice,
    SpeedChoices,
    choose,
    compile_rule,
    engine_compile_rule,
    head_kernels_missing,
    keep_awake_rule,
    keep_logits_rule,
    train_graphs_rule,
)
from ..memory.budget import (
    ModelShape,
    UnknownShape,
    adamw_state_bytes,
    free_memory_bytes,
    kept_engine_bytes,
    kept_logits_bytes,
    response_tokens_of,
)
from ..memory.plan import Measures, MemoryPlan, PlanFacts, asked_from_config, choose_plan, fixed_bytes, peak_bytes
from ..parallel.fsdp import decoder_layers
from ..resolve import resolve_compile_cache_dir
from ..roles.forward import supports_packing
from ..roles.train_graphs import unsupported
from ..rollout import RolloutEngine
from ..rollout.engine import engine_slot_tokens
from ..rollout.fused import decodes_fused

if TYPE_CHECKING:
    from ..config import Config, Derived
    from .settings import Roles

log = logging.getLogger("phaserl")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


BITWISE_EAGER = (False, "rollout.bitwise: the batch-invariant kernels run eager")


def _compile_choice(key: str, asked, model: torch.nn.Module, device: torch.device, world_size: int,
                    bitwise: bool = False) -> Choice:
    return choose(key, asked, BITWISE_EAGER if bitwise else compile_rule(
        native=supports_packing(model), device_type=device.type, triton=triton_available(),
        num_params=_params(model), world_size=world_size, model_name=type(model).__name__))


def choose_speed(cfg: "Config", roles: "Roles", d: "Derived", *, world_size: int) -> SpeedChoices:
    """Every auto speed setting of `cfg` decided for this machine and these (loaded) roles."""
    actor, critic, r = roles.actor, roles.critic, cfg.rollout
    device = actor.device
    engine_runs = r.engine != "hf" and RolloutEngine.supports(actor.model)
    engine_compile = choose("rollout.engine_compile", r.engine_compile, BITWISE_EAGER if r.bitwise else
                            engine_compile_rule(engine_runs=engine_runs, device_type=device.type,
                                                triton=triton_available(),
                                                fused=engine_runs and decodes_fused(actor.model)))
    actor_compile = _compile_choice("actor.compile", cfg.actor.compile, actor.model, device, world_size, r.bitwise)
    free, held = free_memory_bytes(device), 0  # off CUDA the host's available memory (nothing is planned there)
    if device.type == "cuda":
        held = torch.cuda.memory_reserved(device)
    count = UpdateCount.of(cfg, roles, compiled=actor_compile.value, free_bytes=int(free), held_bytes=held,
                           sequence_tokens=d.sequence_tokens, mini_batch_sequences=d.mini_batch_per_rank,
                           world_size=world_size, device_type=device.type)
    may_keep = engine_runs and r.engine_keep_awake is not False  # the plan leaves room for a kept engine
    plan = memory_plan(cfg, count, may_keep=may_keep and r.engine_keep_awake is True)
    if may_keep and r.engine_keep_awake is None and plan.measures == Measures():
        roomy = memory_plan(cfg, count, may_keep=True)  # as before: the micro-batch leaves a kept engine its room,
        plan = roomy if roomy.measures == Measures() else plan  # but no measure is taken for a kept engine's sake
        count.measures = plan.measures
    micro = plan.micro_batch_tokens
    keep_rule = (False, "")  # not used when the config sets it
    if r.engine_keep_awake is None and plan.measures != Measures():  # a kept engine is speed; memory comes first
        keep_rule = (False, "the memory plan takes measures (the step fits only with them): no room for a kept "
                            "engine")
    elif r.engine_keep_awake is None:
        needed = {"needed_bytes": 0, "kept_bytes": 0, "budget_bytes": 0}
        if engine_runs and device.type == "cuda":
            tokens = min(micro.value, d.mini_batch_per_rank * count.sequence_tokens)
            needed = {"needed_bytes": count.peak(tokens, kept=True), "kept_bytes": count.kept_bytes,
                      "budget_bytes": count.budget_bytes}
        keep_rule = keep_awake_rule(engine_runs=engine_runs, device_type=device.type, world_size=world_size,
                                    actor_sharded=cfg.actor.fsdp.sharding_strategy != "NO_SHARD",
                                    lora=bool(cfg.actor.lora.rank), **needed)
    keep_awake = choose("rollout.engine_keep_awake", r.engine_keep_awake, keep_rule)
    head = dict(device_type=device.type, triton=triton_available(), compiled=actor_compile.value,
                plain_head=supports_packing(actor.model) and getattr(actor.model, "plain_head", False))
    keep_logits = choose("ppo.keep_head_logits", cfg.ppo.keep_head_logits, _keep_logits_rule(
        cfg, count, head, micro_tokens=micro.value, mini_batch_tokens=d.mini_batch_per_rank * count.sequence_tokens,
        kept=engine_runs and keep_awake.value))
    if cfg.ppo.keep_head_logits and (missing := head_kernels_missing(**head)):
        log.warning(f"ppo.keep_head_logits=true is ignored: {missing}; the head recomputes its logits")
    kept = engine_runs and keep_awake.value
    if count.shape is not None:  # the predicted peak as the run will be: the engine kept or not, logits kept or not
        tokens = min(micro.value, d.mini_batch_per_rank * count.sequence_tokens)
        logits = kept_logits_bytes(count.shape, response_tokens_of(tokens, count.sequence_tokens,
                                                                   cfg.data.max_prompt_length))
        plan = dataclasses.replace(plan, peak_bytes=count.peak(tokens, kept=kept) + (
            logits if keep_logits.value and not head_kernels_missing(**head) else 0))
    return SpeedChoices(
        actor_compile=actor_compile,
        critic_compile=None if critic is None else _compile_choice("critic.compile", cfg.critic.compile, critic.model,
                                                                   device, world_size, r.bitwise),
        engine_compile=engine_compile,
        engine_keep_awake=keep_awake,
        micro_batch_tokens=micro, keep_head_logits=keep_logits, stream_reference=plan.stream_reference,
        checkpoint_layers=plan.checkpoint_layers, optimizer_offload=plan.optimizer_offload,
        offload_activations=plan.offload_activations,
        memory_plan=plan.summary() if count.shape is not None else "",
        memory=(count.facts(kept=kept), plan) if count.shape is not None else None)


def memory_plan(cfg: "Config", count: "UpdateCount", *, may_keep: bool) -> MemoryPlan:
    """memory/plan.py's plan on this run's count (`may_keep`: room is left for a kept engine); `count` then peaks
    under the plan's measures. Without a count (a model whose shape is unknown) nothing is planned."""
    if count.shape is None:
        return _unplanned(cfg, count)
    plan = choose_plan(count.facts(kept=may_keep), asked_from_config(cfg, count.shape.num_layers))
    count.measures = plan.measures
    return plan


def _unplanned(cfg: "Config", count: "UpdateCount") -> MemoryPlan:
    why = "no memory count for this model"
    a = cfg.actor
    micro = choose("ppo.micro_batch_tokens", cfg.ppo.micro_batch_tokens,
                   (max(count.sequence_tokens, MICRO_BATCH_OFF_CUDA), f"{why}: the fixed default"))
    layers = choose("actor.checkpoint_layers", count.num_layers if a.gradient_checkpointing else a.checkpoint_layers,
                    (0, why))
    return MemoryPlan(choose("ref.stream_weights", cfg.ref.stream_weights, (False, why)), layers,
                      choose("actor.optimizer_offload", a.optimizer_offload, (False, why)), micro,
                      measures=Measures(bool(cfg.ref.stream_weights), layers.value, bool(a.optimizer_offload),
                                        bool(a.offload_activations)),
                      peak_bytes=0, budget_bytes=count.budget_bytes, kv_sequences=-1,
                      offload_activations=choose("actor.offload_activations", a.offload_activations, (False, why)))


def _keep_logits_rule(cfg: "Config", count: "UpdateCount", head: dict, *, micro_tokens: int, mini_batch_tokens: int,
                      kept: bool) -> tuple[bool, str]:
    """config/auto.keep_logits_rule on this run's facts: `head`, whether the Triton log-prob kernels run for the actor
    (head_kernels_missing's arguments), and the memory count at the chosen micro-batch."""
    if count.shape is None:
        return False, "no memory count for this model"
    tokens = min(micro_tokens, mini_batch_tokens)
    logits = kept_logits_bytes(count.shape, response_tokens_of(tokens, count.sequence_tokens,
                                                               cfg.data.max_prompt_length))
    return keep_logits_rule(**head, peak_bytes=count.peak(tokens, kept=kept), logits_bytes=logits,
                            fixed_bytes=count.fixed_bytes(kept=kept), budget_bytes=count.budget_bytes)


@dataclass
class UpdateCount:
    """The memory budget's count of this run's update on this process's device: the loaded roles' resident bytes
    (weights, and for what trains AdamW's moments; a LoRA reference shares the actor's base), the actor's gradients,
    the bytes a kept engine holds (KV pool, recurrent state, route record, weight copies), the device memory this
    process can have (free + what it holds already), and how a micro-batch's activations grow (`peak`), under the
    memory plan's measures once they are chosen (`measures`)."""

    shape: Optional[ModelShape]
    resident: int
    grads: int
    kept_bytes: int
    budget_bytes: int
    sequence_tokens: int
    gradient_checkpointing: bool
    compiled: bool
    actor_bytes: int = 0        # the actor's weights (of `resident`)
    actor_adamw: int = 0        # the actor's AdamW state (of `resident`)
    trained_dtype: str = ""     # the actor's trained weights' dtype (float16: AdamW on float32 masters)
    ref_bytes: int = 0          # a separate reference's weights (of `resident`)
    ref_layer_bytes: int = 0    # of which in its decoder layers
    mini_batch_sequences: int = 1
    world_size: int = 1
    device_type: str = "cpu"
    kv_fraction: float = 0.4
    sequences_per_call: int = 1
    routes: bool = False
    selective: bool = True      # phaserl's decoder checkpoints any number of layers; transformers all or none
    num_layers: int = 0         # the actor's decoder layers
    measures: Measures = Measures()

    @classmethod
    def of(cls, cfg: "Config", roles: "Roles", *, compiled: bool, free_bytes: int, held_bytes: int,
           sequence_tokens: int, mini_batch_sequences: int = 1, world_size: int = 1,
           device_type: str = "cpu") -> "UpdateCount":
        """free_bytes: the device's free memory now (the engine's KV pool is a fraction of it); held_bytes: what
        this process's allocator holds already; sequence_tokens: a slot (Derived.sequence_tokens)."""
        seq = sequence_tokens
        layers = decoder_layers(roles.actor.model)
        try:
            shape = ModelShape.of(roles.actor.model)
        except UnknownShape:  # our decoder always has a shape: count nothing, and the rules stay careful
            shape = None
        ref = roles.ref_policy.model if roles.ref_policy else None
        models = [(roles.actor.model, True), (roles.critic.model if roles.critic else None, True), (ref, False),
                  (getattr(roles.reward.reward_model, "model", None), False)]
        seen, held, grads, adam = set(), [0, 0, 0, 0], 0, 0  # per model: weights (+ AdamW for what trains)
        for i, (model, trains) in enumerate(models):  # the doctor's role_memory, per tensor: a LoRA reference
            for p in model.parameters() if model is not None else ():  # shares the actor's base
                if id(p) in seen:
                    continue
                seen.add(id(p))
                size = p.numel() * p.element_size()
                trainable = size if trains and p.requires_grad else 0
                state = adamw_state_bytes(trainable, p.dtype)  # float16: float32 masters and moments (x6)
                held[i] += size + state
                grads += trainable if i == 0 else 0
                adam += state if i == 0 else 0
        ref_layers = 0
        if ref is not None and held[2]:
            ref_layers = sum(p.numel() * p.element_size() for layer in decoder_layers(ref) for p in layer.parameters())
        r = cfg.rollout
        kept = 0 if shape is None else kept_engine_bytes(shape, r.engine_max_slots, engine_slot_tokens(seq),
                                                         kv_limit=int(r.engine_memory_fraction * free_bytes),
                                                         routes=cfg.actor.routing_replay)
        return cls(shape, sum(held), grads, kept, free_bytes + held_bytes, seq, cfg.actor.gradient_checkpointing,
                   compiled, actor_bytes=held[0] - adam, actor_adamw=adam,
                   trained_dtype=_trained_dtype(roles.actor.model), ref_bytes=held[2], ref_layer_bytes=ref_layers,
                   mini_batch_sequences=mini_batch_sequences, world_size=world_size, device_type=device_type,
                   kv_fraction=r.engine_memory_fraction, sequences_per_call=r.batch_size * r.n,
                   routes=cfg.actor.routing_replay, selective=supports_packing(roles.actor.model),
                   num_layers=len(layers), measures=Measures(layers=len(layers) if cfg.actor.gradient_checkpointing
                                                             else 0))

    def facts(self, *, kept: bool) -> PlanFacts:
        """The plan's facts: this count, with a kept engine's bytes when `kept`."""
        return PlanFacts(shape=self.shape, device_type=self.device_type, budget_bytes=self.budget_bytes,
                         actor_params=self.actor_bytes, actor_trainable=self.grads, ref_bytes=self.ref_bytes,
                         ref_layer_bytes=self.ref_layer_bytes,
                         other_bytes=self.resident - self.actor_bytes - self.actor_adamw - self.ref_bytes,
                         kept_bytes=self.kept_bytes if kept else 0, sequence_tokens=self.sequence_tokens,
                         mini_batch_sequences=self.mini_batch_sequences, compiled=self.compiled,
                         world_size=self.world_size, selective=self.selective, kv_fraction=self.kv_fraction,
                         sequences_per_call=self.sequences_per_call, routes=self.routes,
                         trained_dtype=self.trained_dtype)

    def fixed_bytes(self, *, kept: bool) -> int:
        return fixed_bytes(self.facts(kept=kept), self.measures)

    def peak(self, tokens: int, *, kept: bool) -> int:
        """The update's peak with a micro-batch of `tokens` (unknown shape: more than any device has)."""
        if self.shape is None:
            return 2**62
        return peak_bytes(self.facts(kept=kept), self.measures, tokens)


def _trained_dtype(model) -> str:
    """The dtype of the weights AdamW steps (a LoRA model's float32 adapters, not its base); '' when none train."""
    trained = next((p for p in model.parameters() if p.requires_grad), None)
    return "" if trained is None else str(trained.dtype).removeprefix("torch.")


def train_graphs_choice(asked: Optional[bool], actor, *, world_size: int) -> Choice:
    """ppo.train_graphs for the actor, once set_packing chose its packing (config/auto.train_graphs_rule); `true`
    where the graphs cannot run is a warning and off."""
    why_not = unsupported(actor.model)
    blocked = ("" if world_size == 1 else f"{world_size} ranks") or ("" if actor.packing else "ppo.packing is off") \
        or why_not
    if asked and blocked:
        log.warning(f"ppo.train_graphs=true is ignored: {blocked}")
        return Choice("ppo.train_graphs", asked, False, f"ignored: {blocked}")
    return choose("ppo.train_graphs", asked, train_graphs_rule(why_not=why_not, packing=actor.packing,
                                                                world_size=world_size))


def packing_choice(asked: Optional[bool], enabled: bool, device: torch.device) -> Choice:
    """ppo.packing as set_packing chose it for the actor (its rule: models.decoder.use_varlen)."""
    why = ("the varlen flash kernel runs here (CUDA, bf16/fp16 compute)" if enabled else
           f"{device.type.upper()}: no varlen kernel (CPU or float32), a dense block mask costs more than the padding")
    return choose("ppo.packing", asked, (enabled, why))


def compile_watch(speed: SpeedChoices, roles: "Roles", *, rank: int) -> Optional[CompileWatch]:
    """The console lines around the first compiled step (rank 0, when something compiles), announced now.
    Its key (torch version, device, model shape and dtype, what compiles) says which cached timings apply."""
    if not speed.compiles or rank != 0:
        return None
    decoder = speed.actor_compile.value or bool(speed.critic_compile and speed.critic_compile.value)
    parts = [name for name, on in (("the decoder layers", decoder),
                                   ("the rollout engine's layers", speed.engine_compile.value)) if on]
    model, device = roles.actor.model, roles.actor.device
    c = getattr(model, "config", None)
    shape = "-".join(str(getattr(c, k, "?")) for k in ("model_type", "hidden_size", "num_hidden_layers"))
    key = "|".join([torch.__version__, torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
                    shape, str(next(model.parameters()).dtype), "+".join(parts)])
    watch = CompileWatch(" and ".join(parts), key, enable_compile_cache(resolve_compile_cache_dir()),
                         device_type=device.type)
    log.info(watch.announce())
    return watch
