"""What a checkpoint holds, and how each piece is collected from and restored into a live run.

    dcp/                      torch.distributed.checkpoint of the roles' tensors ({role}/model/...,
                              {role}/optim/state/...): every rank writes its shards, any world size reads
                              them back (resharding is DCP's job); tensors only (safe_dcp.py)
    roles.json                everything else in the roles' state dicts: optimizer param_groups, LR
                              scheduler state (JSON, with each tensor's place marked)
    rng/rank_{r}.safetensors  rank r's RNG states (rng.py)
    trainer_state.json        the step and the small JSON states: trainer loop, KL controller, prompt loader
    architecture/{role}.json  each role's HF config and dtype, so `export` needs no base model (with LoRA:
                              dcp/ holds only the trainable state, and this names the base directory)
    tokenizer/                the tokenizer files

A role gives its state dicts: `role.checkpoint_state_dicts()` and `role.load_checkpoint_state_dicts(sd)`
when it defines them (e.g. a role that saves only its adapters), else {model, optim, scheduler} from
`.model` and `.optimizer` (roles.optim.Optimizer: `.opt` AdamW, `.sched` LR scheduler). Nothing here
knows which files are complete (store.py, manifest.py) or when to save (the Checkpointer).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..errors import CheckpointError
from ..models.config import DecoderConfig
from ..models.families import config_to_hf
from ..models.lora import has_lora, lora_record, state_dict_options
from .safe_dcp import load_tensors, save_tensors
from .store import write_json

DCP_DIR, RNG_DIR, STATE_FILE, ARCH_DIR, TOKENIZER_DIR = "dcp", "rng", "trainer_state.json", "architecture", "tokenizer"
ROLES_FILE = "roles.json"
_TENSOR, _TUPLE, _ITEMS = "__tensor__", "__tuple__", "__items__"   # markers in roles.json


@dataclass
class TrainingState:
    """The live objects a checkpoint captures (RLTrainer.checkpoint_state() builds one)."""
    step: int
    roles: dict                                      # "actor"/"critic" -> role
    stateful: dict = field(default_factory=dict)     # name -> object with JSON state_dict()/load_state_dict()
    generators: dict = field(default_factory=dict)   # name -> torch.Generator, saved per rank
    tokenizer: Any = None


# ---------------------------------------------------------------------------------------------- roles

def role_state_dicts(role) -> dict:
    """The nested state of one role: tensors (plain or DTensor) and plain values."""
    if hasattr(role, "checkpoint_state_dicts"):
        return role.checkpoint_state_dicts()
    optim = role.optimizer
    return {"model": get_model_state_dict(role.model),
            "optim": get_optimizer_state_dict(role.model, optim.opt),
            "scheduler": optim.sched.state_dict()}


def restore_role(role, state: dict) -> None:
    if hasattr(role, "load_checkpoint_state_dicts"):
        role.load_checkpoint_state_dicts(state)
        return
    set_model_state_dict(role.model, state["model"])
    set_optimizer_state_dict(role.model, role.optimizer.opt, state["optim"])
    role.optimizer.sched.load_state_dict(state["scheduler"])


def split_tensors(obj, prefix: str, tensors: dict):
    """`obj` with each tensor replaced by {"__tensor__": key} (tensors[key] = the tensor): a JSON-able tree."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj
        return {_TENSOR: prefix}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: split_tensors(v, f"{prefix}/{k}", tensors) for k, v in obj.items()}
        return {_ITEMS: [[k, split_tensors(v, f"{prefix}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        items = [split_tensors(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]
        return {_TUPLE: items} if isinstance(obj, tuple) else items
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(f"cannot store {prefix} ({type(obj).__name__}) in a checkpoint: role state must be "
                          "tensors and plain numbers, strings, lists and dicts")


def join_tensors(plain, tensors: dict, source: str):
    """The inverse of split_tensors: markers replaced by tensors[key]."""
    if isinstance(plain, dict):
        if set(plain) == {_TENSOR}:
            key = plain[_TENSOR]
            if key not in tensors:
                raise CheckpointError(f"{source} names a tensor {key!r} that this run's models do not have; the "
                                      "checkpoint is for another model or setup")
            return tensors[key]
        if set(plain) == {_TUPLE}:
            return tuple(join_tensors(v, tensors, source) for v in plain[_TUPLE])
        if set(plain) == {_ITEMS}:
            return {k: join_tensors(v, tensors, source) for k, v in plain[_ITEMS]}
        return {k: join_tensors(v, tensors, source) for k, v in plain.items()}
    if isinstance(plain, list):
        return [join_tensors(v, tensors, source) for v in plain]
    return plain


def save_roles(roles: dict, ckpt_dir: str) -> dict:
    """Collective: every rank writes its tensor shards into dcp/.  Returns the plain part (roles.json's content)."""
    tensors: dict = {}
    plain = {name: split_tensors(role_state_dicts(role), name, tensors) for name, role in roles.items()}
    save_tensors(tensors, os.path.join(ckpt_dir, DCP_DIR))
    return plain


def load_roles(roles: dict, ckpt_dir: str) -> None:
    """Collective: fill the roles' weights, optimizer and LR schedule in place from `ckpt_dir`."""
    # The template's tensors are the live ones (resharded by DCP for this world size); load fills them.
    template: dict = {}
    for name, role in roles.items():
        split_tensors(role_state_dicts(role), name, template)
    plain_file = os.path.join(ckpt_dir, ROLES_FILE)
    plain = read_json(plain_file)
    load_tensors(template, os.path.join(ckpt_dir, DCP_DIR))
    for name, role in roles.items():
        if name not in plain:
            raise CheckpointError(f"{plain_file} has no state for role {name!r}")
        restore_role(role, join_tensors(plain[name], template, plain_file))


def load_module(module: torch.nn.Module, ckpt_dir: str, role: str) -> None:
    """Fill `module`'s weights from role `role` of a checkpoint (one process, for export); a LoRA module takes
    its trainable state only (the base came from its own directory)."""
    options = state_dict_options(module)
    template = {f"{role}/model/{k}": v for k, v in get_model_state_dict(module, options=options).items()}
    load_tensors(template, os.path.join(ckpt_dir, DCP_DIR), no_dist=True)
    set_model_state_dict(module, {k.removeprefix(f"{role}/model/"): v for k, v in template.items()}, options=options)


# ---------------------------------------------------------------------------------------------- JSON state

def read_json(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete: use an earlier step_N") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); the checkpoint is damaged: use an earlier "
                              "step_N") from None


def save_json_state(state: TrainingState, path: str) -> None:
    write_json(path, {"step": state.step, **{name: obj.state_dict() for name, obj in state.stateful.items()}})


def load_json_state(state: TrainingState, path: str) -> dict:
    saved = read_json(path)
    missing = [name for name in state.stateful if name not in saved] if isinstance(saved, dict) else ["everything"]
    if missing:
        raise CheckpointError(f"{path} has no state for {missing}; it was written by another phaserl version or "
                              "for another kind of run. Start a new run (trainer.resume=never) or resume a "
                              "matching one.")
    for name, obj in state.stateful.items():
        try:
            obj.load_state_dict(saved[name])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: the {name!r} state does not fit this run ({type(exc).__name__}: {exc}); "
                                  "it was written by another phaserl version or edited by hand") from None
    return saved


# ---------------------------------------------------------------------------------------------- architecture

def architecture(model: torch.nn.Module) -> dict:
    """What export needs to rebuild `model` empty: the HF config dict, dtype and which class family."""
    dtype = str(model.get_parameter(_first_frozen_or_any(model)).dtype).removeprefix("torch.")
    config = model.config
    lora = {"lora": lora_record(model)} if has_lora(model) else {}  # adapters only in dcp/: the base's directory
    if isinstance(config, DecoderConfig):              # ours (CausalLM, ValueModel)
        # Read from a multimodal Gemma 4 directory: export writes the composite again, its towers from there.
        composite = getattr(model, "hf_composite", None)
        source = {"gemma4_composite": composite.record()} if composite is not None else {}
        return {"kind": "native", "dtype": dtype, "hf_config": config_to_hf(config, dtype), **lora, **source}
    return {"kind": "transformers", "dtype": dtype, "hf_config": config.to_dict(), **lora}


def _first_frozen_or_any(model: torch.nn.Module) -> str:
    # A LoRA model's adapters are float32 whatever the base is: the base's dtype is the model's.
    frozen = (name for name, p in model.named_parameters() if not p.requires_grad)
    return next(frozen, next(name for name, _ in model.named_parameters()))


def save_architecture(state: TrainingState, directory: str) -> None:
    os.makedirs(os.path.join(directory, ARCH_DIR), exist_ok=True)
    for name, role in state.roles.items():
        write_json(os.path.join(directory, ARCH_DIR, f"{name}.json"), architecture(role.model))
    if state.tokenizer is not None:
        state.tokenizer.save_pretrained(os.path.join(directory, TOKENIZER_DIR))


def read_architecture(ckpt_dir: str, role: str) -> Optional[dict]:
    path = os.path.join(ckpt_dir, ARCH_DIR, f"{role}.json")
    if not os.path.isfile(path):
        return None
    return read_json(path)
