"""What a checkpoint holds, and how each piece is collected from and restored into a live run.

    dcp/                      torch.distributed.checkpoint of {role: {model, optim, scheduler}} for the
                              trainable roles (actor, critic): every rank writes its shards, any world
                              size reads them back (resharding is DCP's job)
    rng/rank_{r}.pt           rank r's RNG states: torch CPU, CUDA, python `random`, numpy, and the run's
                              named generators (the rollout sampler)
    trainer_state.json        the step and the small JSON states: trainer loop, KL controller, prompt loader
    architecture/{role}.json  each role's HF config and dtype, so `export` needs no base model
    tokenizer/                the tokenizer files

The Checkpointer (__init__.py) decides when and where; store.py makes it atomic. Roles are duck-typed:
`.model` (nn.Module) and `.optimizer` (roles.optim.Optimizer: `.opt` AdamW, `.sched` LR scheduler).
"""
from __future__ import annotations

import json
import logging
import os
import random
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from ..errors import ConfigError
from ..parallel import is_distributed
from .store import fsync_path, write_json

log = logging.getLogger("phaserl")

DCP_DIR, RNG_DIR, STATE_FILE, ARCH_DIR, TOKENIZER_DIR = "dcp", "rng", "trainer_state.json", "architecture", "tokenizer"


@dataclass
class TrainingState:
    """The live objects a checkpoint captures (RLTrainer.checkpoint_state() builds one)."""
    step: int
    roles: dict                                      # "actor"/"critic" -> role (.model, .optimizer)
    stateful: dict = field(default_factory=dict)     # name -> object with JSON state_dict()/load_state_dict()
    generators: dict = field(default_factory=dict)   # name -> torch.Generator, saved per rank
    tokenizer: Any = None


# ---------------------------------------------------------------------------------------------- roles (DCP)

def _role_state_dicts(roles: dict) -> dict:
    out = {}
    for name, role in roles.items():
        optim = role.optimizer
        out[name] = {"model": get_model_state_dict(role.model),
                     "optim": get_optimizer_state_dict(role.model, optim.opt),
                     "scheduler": optim.sched.state_dict()}
    return out


@contextmanager
def _single_process_ok():
    # DCP warns on every call without a process group; one process is phaserl's default, not a mistake.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_roles(roles: dict, directory: str) -> None:
    """Collective: every rank writes its part of each role's weights, optimizer and LR schedule."""
    with _single_process_ok():
        dcp.save(_role_state_dicts(roles), checkpoint_id=directory, no_dist=not is_distributed())


def load_roles(roles: dict, directory: str) -> None:
    """Collective: fill the roles' weights, optimizer and LR schedule in place from `directory`."""
    # The template's tensors are the live ones (resharded by DCP for this world size); load fills them.
    template = _role_state_dicts(roles)
    with _single_process_ok():
        dcp.load(template, checkpoint_id=directory, no_dist=not is_distributed())
    for name, role in roles.items():
        set_model_state_dict(role.model, template[name]["model"])
        set_optimizer_state_dict(role.model, role.optimizer.opt, template[name]["optim"])
        role.optimizer.sched.load_state_dict(template[name]["scheduler"])


def load_module(module: torch.nn.Module, directory: str, role: str) -> None:
    """Fill `module`'s weights from role `role` of a checkpoint's dcp/ directory (one process, for export)."""
    template = {role: {"model": module.state_dict()}}
    with _single_process_ok():
        dcp.load(template, checkpoint_id=directory, no_dist=True)
    module.load_state_dict(template[role]["model"], strict=True)


# ---------------------------------------------------------------------------------------------- RNG

def rng_state(generators: dict) -> dict:
    np_state = np.random.get_state()
    return {"torch_cpu": torch.get_rng_state(),
            # only a process that uses CUDA has CUDA RNG to save (and asking would initialize CUDA)
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
            "python": random.getstate(),
            # numpy's state holds an ndarray; as plain lists the file loads with weights_only=True
            "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "generators": {name: g.get_state() for name, g in generators.items()}}


def save_rng(generators: dict, directory: str, rank: int) -> None:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"rank_{rank}.pt")
    torch.save(rng_state(generators), path)
    fsync_path(path)


def load_rng(generators: dict, directory: str, rank: int, seed_hint: str) -> bool:
    """Restore rank `rank`'s RNG states; False (and a warning) when the checkpoint has none for it."""
    path = os.path.join(directory, f"rank_{rank}.pt")
    if not os.path.isfile(path):
        # Not a warning: phaserl reseeds rollout sampling per generate call (seed, step, prompt index) and the
        # mini-batch order per step, so its own randomness does not depend on the state that is missing here.
        log.info(f"checkpoint: no RNG state for rank {rank} in {directory} (saved with fewer ranks); this rank's "
                 f"torch/python/numpy RNG stays {seed_hint}. phaserl's sampling does not read it (each generate "
                 "call is reseeded from the seed, step and prompt index), so only your own code that draws random "
                 "numbers (a reward function, a hook) can differ from an uninterrupted run")
        return False
    state = torch.load(path, weights_only=True)
    torch.set_rng_state(state["torch_cpu"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    for name, generator in generators.items():
        if name in state["generators"]:
            generator.set_state(state["generators"][name])
    return True


# ---------------------------------------------------------------------------------------------- JSON state

def save_json_state(state: TrainingState, path: str) -> None:
    write_json(path, {"step": state.step, **{name: obj.state_dict() for name, obj in state.stateful.items()}})


def load_json_state(state: TrainingState, path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    missing = [name for name in state.stateful if name not in saved]
    if missing:
        raise ConfigError(f"{path} has no state for {missing}; it was written by another phaserl version or "
                          "for another kind of run. Start a new run (trainer.resume=never) or resume a matching one.")
    for name, obj in state.stateful.items():
        obj.load_state_dict(saved[name])
    return saved


# ---------------------------------------------------------------------------------------------- architecture

def architecture(model: torch.nn.Module) -> dict:
    """What export needs to rebuild `model` empty: the HF config dict, dtype and which class family."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    config = model.config
    if hasattr(config, "to_hf_dict"):                  # our DecoderConfig (CausalLM, ValueModel)
        return {"kind": "native", "dtype": dtype, "hf_config": config.to_hf_dict(dtype)}
    return {"kind": "transformers", "dtype": dtype, "hf_config": config.to_dict()}


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
    with open(path, encoding="utf-8") as f:
        return json.load(f)
