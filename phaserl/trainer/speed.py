"""The speed settings that depend on the machine, chosen once when the run is built, and the block that says
which were chosen and why.

`choose_speed(cfg, roles, derived, world_size)` gathers the facts (device, Triton, which models are phaserl's
decoder and how big, world size, and for `rollout.engine_keep_awake` the doctor's memory count of the update
with the engine kept against this process's device memory) and applies `config/auto.py`'s rule to every
setting left at auto (null); true / false in the config win. The builder applies the choices and keeps them in
`RunSettings.speed`; the run summary prints one line per choice (`Choice.line()`):

    auto       actor.compile=auto -> on: CUDA, phaserl's decoder, Triton
               rollout.engine_keep_awake=auto -> on: 24.3 GiB needed of 139 GiB
               ...

Not here: the rules (config/auto.py), the memory formulas (doctor/memory.py), torch's compile caches
(compile_cache.py), `ppo.packing`'s per-role choice (build.set_packing: it is reported here as made).
"""
from __future__ import annotations

import importlib.util
import logging
from typing import TYPE_CHECKING, Optional

import torch

from ..compile_cache import CompileWatch, enable_compile_cache
from ..config.auto import (Choice, SpeedChoices, choose, compile_rule, engine_compile_rule, extend_graphs_rule,
                           keep_awake_rule)
from ..doctor.memory import ModelShape, UnknownShape, kept_engine_bytes, update_peak_bytes
from ..resolve import resolve_compile_cache_dir
from ..roles.forward import supports_packing
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


def _compile_choice(key: str, asked, model: torch.nn.Module, device: torch.device, world_size: int) -> Choice:
    return choose(key, asked, compile_rule(native=supports_packing(model), device_type=device.type,
                                           triton=triton_available(), num_params=_params(model),
                                           world_size=world_size, model_name=type(model).__name__))


def choose_speed(cfg: "Config", roles: "Roles", d: "Derived", *, world_size: int) -> SpeedChoices:
    """Every auto speed setting of `cfg` decided for this machine and these (loaded) roles."""
    actor, critic, r = roles.actor, roles.critic, cfg.rollout
    device = actor.device
    engine_runs = r.engine != "hf" and RolloutEngine.supports(actor.model)
    engine_compile = choose("rollout.engine_compile", r.engine_compile, engine_compile_rule(
        engine_runs=engine_runs, device_type=device.type, triton=triton_available(),
        fused=engine_runs and decodes_fused(actor.model)))
    actor_compile = _compile_choice("actor.compile", cfg.actor.compile, actor.model, device, world_size)
    keep_rule = (False, "")  # not used when the config sets it
    if r.engine_keep_awake is None:
        count = {"needed_bytes": 0, "kept_bytes": 0, "budget_bytes": 0}
        if engine_runs and device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            count = keep_awake_count(cfg, roles, d, free_bytes=int(free), held_bytes=torch.cuda.memory_reserved(device),
                                     compiled=actor_compile.value)
        keep_rule = keep_awake_rule(engine_runs=engine_runs, device_type=device.type, world_size=world_size,
                                    actor_sharded=cfg.actor.fsdp.sharding_strategy != "NO_SHARD",
                                    lora=bool(cfg.actor.lora.rank), **count)  # needed, kept and budget bytes
    return SpeedChoices(
        actor_compile=actor_compile,
        critic_compile=None if critic is None else _compile_choice("critic.compile", cfg.critic.compile, critic.model,
                                                                   device, world_size),
        engine_compile=engine_compile,
        engine_keep_awake=choose("rollout.engine_keep_awake", r.engine_keep_awake, keep_rule),
        engine_extend_graphs=None if not cfg.agent.env else choose(
            "rollout.engine_extend_graphs", r.engine_extend_graphs, extend_graphs_rule(
                engine_runs=engine_runs, device_type=device.type, cuda_graphs=r.engine_cuda_graphs)))


def keep_awake_count(cfg: "Config", roles: "Roles", d: "Derived", *, free_bytes: int, held_bytes: int,
                     compiled: bool = False) -> dict:
    """The doctor's count for this run: the update's peak with the engine kept (needed_bytes: the loaded roles'
    weights, the trainable ones' gradients and AdamW moments, one micro-batch's activations (`compiled`: the
    actor's layers run through torch.compile) and log-prob chunk, the engine's KV pool, recurrent state, route
    record and weight copies) and the device memory this process can have (budget_bytes: free + what it holds
    already)."""
    actor = roles.actor
    try:
        shape = ModelShape.of(actor.model)
    except UnknownShape:  # our decoder always has a shape; keep the engine asleep if not
        return {"needed_bytes": 2**62, "budget_bytes": 1}
    models = [(actor.model, True), (roles.critic.model if roles.critic else None, True),
              (roles.ref_policy.model if roles.ref_policy else None, False),
              (getattr(roles.reward.reward_model, "model", None), False)]
    seen, resident, grads = set(), 0, 0
    for model, trains in models:  # the doctor's role_memory, per tensor: a LoRA reference shares the actor's base
        for p in model.parameters() if model is not None else ():
            if id(p) in seen:
                continue
            seen.add(id(p))
            size = p.numel() * p.element_size()
            trainable = size if trains and p.requires_grad else 0
            resident, grads = resident + size + 2 * trainable, grads + trainable  # params + AdamW; gradients
    seq = cfg.agent.max_episode_tokens if cfg.agent.env or cfg.agent.harness else d.max_sequence_tokens  # a slot
    micro = min(cfg.ppo.micro_batch_tokens, d.mini_batch_per_rank * seq)
    peak = update_peak_bytes(shape, resident=resident, grads=grads, micro_batch_tokens=micro,
                             gradient_checkpointing=cfg.actor.gradient_checkpointing, compiled=compiled,
                             sequence_tokens=seq)
    r = cfg.rollout
    kept = kept_engine_bytes(shape, r.engine_max_slots, engine_slot_tokens(seq),
                             kv_limit=int(r.engine_memory_fraction * free_bytes), routes=cfg.actor.routing_replay)
    return {"needed_bytes": peak + kept, "kept_bytes": kept, "budget_bytes": free_bytes + held_bytes}


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
