"""FSDP2 per role: `apply_fsdp(model, mesh, settings, role=...)`, and the actor's gather/reshard around rollout.

Scope: wrapping one role's model with `torch.distributed.fsdp.fully_shard` on a `DeviceMesh` (one FSDP unit
per decoder layer plus a root unit), and the two calls the actor's mode switch makes. One process (no
process group, or a world of one) wraps nothing: the modules stay plain, `breakpoint()` works. Not here:
launching (launch.py), checkpoints (phaserl.checkpoint saves the sharded modules with DCP), the roles.

Choices, each tested in tests/test_distributed.py:
- Gradients are SUMMED over ranks. Losses are normalized by the mini-batch's global token / sequence
  counts (algo/aggregation.py), so a rank's gradient is its share of the global gradient. FSDP2 averages
  by default; every unit gets `set_gradient_divide_factor(1.0)` and `set_force_sum_reduction_for_comms(True)`,
  which makes the collective a plain SUM (gloo has neither AVG nor PREMUL_SUM).
- The root unit holds the embeddings, the final norm and lm_head (or the value head). `output_weight` is
  used outside `forward` (the chunked log-prob head, the sampler), so the root keeps its parameters gathered
  after forward (`reshard_after_forward=False`, FSDP2's own default for a root): `model.output_weight` is then
  the full tensor, and the gradient the head puts into it is reduced by the root's post-backward.
- NO_SHARD is HSDP on a (world, 1) mesh: shards of one rank (full copies), gradients all-reduced over the
  replicate dimension. That is DDP's semantics through the same code path (unshard, reshard, DCP). A frozen
  role (the reference) with NO_SHARD has no gradient to reduce: it stays a plain module, a full copy per
  rank (cast to `param_dtype`), which also keeps it usable under `torch.inference_mode()` (FSDP2's
  one-rank-shard copy-out in torch 2.13 is not).
- SHARD_GRAD_OP: layers keep their gathered parameters from forward to backward (ZeRO-2-like);
  FULL_SHARD frees them after forward when `reshard_after_forward` (the default).
- Mixed precision: compute in `param_dtype`, reduce gradients in float32. `cast_forward_inputs=False`:
  the inputs are token ids and masks, and casting would copy the KVCache dataclass the decoder advances.
- CPU offload only for forward-only roles (the reference): a trainable role's gradient-norm clipping
  and its `device` (where its batches go) assume parameters on the accelerator.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from ..errors import ConfigError
from .collectives import rank_and_world, training_group

log = logging.getLogger("phaserl")

PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FORWARD_ONLY_ROLES = ("ref", "reward_model")
_LAYER_LIST_NAMES = ("layers", "h", "blocks")
_RESHARD_ATTR = "_phaserl_reshard_after_forward"   # each unit's own setting, restored after rollout
_MESHES: dict = {}


def world_mesh(device_type: str, sharding_strategy: str = "FULL_SHARD") -> DeviceMesh:
    """The data-parallel mesh over the ranks that train (every rank, or the trainer ranks when rollout ranks are
    split off: collectives.training_group): 1-D (FULL_SHARD, SHARD_GRAD_OP), or (world, 1) for NO_SHARD."""
    group = training_group()
    world = dist.get_world_size(group)
    shape, names = ((world, 1), ("replicate", "shard")) if sharding_strategy == "NO_SHARD" else ((world,), ("shard",))
    key = (device_type, shape)
    if key not in _MESHES:  # creating a mesh creates process groups: once per shape, on every rank
        _MESHES[key] = (init_device_mesh(device_type, shape, mesh_dim_names=names) if group is None
                        else _group_mesh(group, device_type, shape, names))
    return _MESHES[key]


def _group_mesh(group, device_type: str, shape: tuple, names: tuple) -> DeviceMesh:
    """The mesh of `shape` over the ranks of `group` alone (the other ranks of the launch take no part)."""
    if len(shape) == 1:
        return DeviceMesh.from_group(group, device_type, mesh_dim_names=names)
    alone = dist.new_group([dist.get_rank()], use_local_synchronization=True)  # the size-1 "shard" dimension
    ranks = torch.tensor(dist.get_process_group_ranks(group)).view(shape)
    return DeviceMesh.from_group([group, alone], device_type, mesh=ranks, mesh_dim_names=names)


def decoder_layers(model: nn.Module) -> list:
    """The repeated blocks of a decoder (`model.layers`, `hf_model.model.layers`, `transformer.h`, ...)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] in _LAYER_LIST_NAMES and len(module):
            return list(module)
    return []


def fsdp_units(model: nn.Module) -> list:
    """Every FSDP unit inside `model`, the root first."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def _check(settings, role: str, device_type: str) -> None:
    if settings.param_dtype is not None and settings.param_dtype not in PARAM_DTYPES:
        raise ConfigError(f"{role}.fsdp.param_dtype={settings.param_dtype!r}: expected one of "
                          f"{', '.join(PARAM_DTYPES)} or null (compute in the parameters' own dtype)")
    if settings.cpu_offload and settings.sharding_strategy == "NO_SHARD":
        raise ConfigError(f"{role}.fsdp: cpu_offload=true with sharding_strategy=NO_SHARD asks for a full copy "
                          f"on every GPU and for the parameters on the CPU; use sharding_strategy=FULL_SHARD "
                          f"with cpu_offload=true (each rank then offloads only its shard)")
    if settings.cpu_offload and role not in FORWARD_ONLY_ROLES and device_type == "cuda":
        raise ConfigError(
            f"{role}.fsdp.cpu_offload=true is not supported: CPU offload is for forward-only roles (ref). A "
            f"trainable {role} clips its gradient norm and places its batches on its parameters' device, both "
            f"of which need the parameters on the GPU. Use sharding_strategy=FULL_SHARD over more GPUs, or, for "
            f"the actor, hybrid_engine.offload_optimizer=true (optimizer state on the CPU during rollout)")


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, settings, *, role: str) -> nn.Module:
    """Shard `model` in place per `settings` (a roles.FSDPSettings): each decoder layer a unit, then the root.

    `mesh` is the 1-D data-parallel mesh over every rank (`world_mesh(device_type)`); NO_SHARD swaps it
    for the (world, 1) mesh. Returns `model` (now also an FSDPModule). Applying twice is a no-op.
    """
    if is_sharded(model):
        return model
    _check(settings, role, mesh.device_type)
    dtype = PARAM_DTYPES[settings.param_dtype] if settings.param_dtype else None
    if settings.sharding_strategy == "NO_SHARD":
        if not any(p.requires_grad for p in model.parameters()):  # frozen: nothing to reduce, keep it plain
            return model.to(dtype) if dtype else model
        mesh = world_mesh(mesh.device_type, "NO_SHARD")
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None,
                              cast_forward_inputs=False)
    offload: OffloadPolicy = OffloadPolicy()
    if settings.cpu_offload:
        if mesh.device_type == "cuda":
            offload = CPUOffloadPolicy(pin_memory=True)
        else:
            log.warning(f"{role}.fsdp.cpu_offload=true is ignored on the CPU: the parameters already live there")
    layer_reshard = settings.reshard_after_forward and settings.sharding_strategy == "FULL_SHARD"
    layers = decoder_layers(model)
    if not layers:
        log.warning(f"{role}: no decoder layer list found in {type(model).__name__}; the whole model is one "
                    "FSDP unit (every parameter gathered at once)")
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=layer_reshard, mp_policy=mp, offload_policy=offload)
        setattr(layer, _RESHARD_ATTR, layer_reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=offload)
    setattr(model, _RESHARD_ATTR, False)
    for unit in fsdp_units(model):
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return model


def shard_roles(roles: dict, device: torch.device) -> None:
    """Apply each role's own FSDPSettings to its model (classic mistake 1: never one config for all roles).

    `roles` maps a role name (actor, critic, ref) to a role object with `.model` and `.fsdp`, or None.
    Needs a process group of 2+ ranks (one process keeps plain modules). Must run before the roles build
    their optimizers, which hold the sharded parameters.
    """
    for name, role in roles.items():
        if role is None:
            continue
        if is_sharded(role.model):  # the reference of a LoRA actor: the actor's own model, sharded once as the actor
            if rank_and_world()[0] == 0:
                log.info(f"[rank 0] {name}: shares a model sharded already (the actor's base, adapters off)")
            continue
        apply_fsdp(role.model, world_mesh(device.type), role.fsdp, role=name)
        if rank_and_world()[0] == 0:
            log.info(f"[rank 0] {name}: {role.fsdp.sharding_strategy}, "
                     f"{sharding_summary(role.model) or 'a plain replica on every rank (frozen, NO_SHARD)'}")


def gather_full_params(model: nn.Module) -> bool:
    """All-gather every unit's shards (layer by layer) and keep them gathered through later forwards.

    The actor's switch to rollout calls this, so decoding does not all-gather on every token. Returns
    False (and does nothing) for a module FSDP does not manage.
    """
    units = fsdp_units(model)
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    return bool(units)


def reshard_params(model: nn.Module) -> bool:
    """Free the gathered parameters and restore each unit's own reshard-after-forward setting."""
    units = fsdp_units(model)
    for unit in units:
        unit.reshard()
        unit.set_reshard_after_forward(getattr(unit, _RESHARD_ATTR, True), recurse=False)
    return bool(units)


def full_state_dict(model: nn.Module) -> dict:
    """Every parameter and buffer as a full (unsharded) CPU tensor, on every rank (for tests and export)."""
    out = {}
    for name, value in model.state_dict().items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        out[name] = value.detach().cpu()
    return out


def sharding_summary(model: nn.Module) -> Optional[str]:
    """One line for logs: units and parameters of this rank vs the whole model, or None when unsharded."""
    units = fsdp_units(model)
    if not units:
        return None
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    return f"{len(units)} FSDP units, {local:,} of {total:,} parameters on this rank"
