"""Per-rank RNG states in a checkpoint: `rng/rank_{r}.safetensors`, no pickle.

One safetensors file per rank holds the byte tensors of torch's CPU generator, each CUDA device's
generator and the run's named generators (the rollout sampler); python `random`'s and numpy's states,
which are lists of integers, travel as JSON in the file's string metadata. Reading it runs no code
(safetensors parses a JSON header and raw bytes). Not here: which generators a run has (TrainingState).
"""
from __future__ import annotations

import json
import logging
import os
import random

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..errors import CheckpointError
from .store import fsync_path

log = logging.getLogger("phaserl")


def rng_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank_{rank}.safetensors")


def save_rng(generators: dict, directory: str, rank: int) -> str:
    """Write this rank's RNG states; returns the file's path."""
    os.makedirs(directory, exist_ok=True)
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_initialized():  # only a process that uses CUDA has CUDA RNG to save (asking would start CUDA)
        tensors.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    tensors.update({f"generator.{name}": g.get_state() for name, g in generators.items()})
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    meta = {"python": json.dumps(random.getstate()),
            "numpy": json.dumps([kind, keys.tolist(), int(pos), int(has_gauss), float(cached)])}
    path = rng_file(directory, rank)
    save_file(tensors, path, metadata=meta)
    fsync_path(path)
    return path


def load_rng(generators: dict, directory: str, rank: int, seed_hint: str) -> bool:
    """Restore rank `rank`'s RNG states; False (and an info line) when the checkpoint has none for it."""
    path = rng_file(directory, rank)
    if not os.path.isfile(path):
        # Not a warning: phaserl reseeds rollout sampling per generate call (seed, step, prompt index) and the
        # mini-batch order per step, so its own randomness does not depend on the state that is missing here.
        log.info(f"checkpoint: no RNG state for rank {rank} in {directory} (saved with fewer ranks); this rank's "
                 f"torch/python/numpy RNG stays {seed_hint}. phaserl's sampling does not read it (each generate "
                 "call is reseeded from the seed, step and prompt index), so only your own code that draws random "
                 "numbers (a reward function, a hook) can differ from an uninterrupted run")
        return False
    try:
        tensors = load_file(path)
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
        python_state, numpy_state = json.loads(meta["python"]), json.loads(meta["numpy"])
        version, internal, gauss = python_state
        kind, keys, pos, has_gauss, cached = numpy_state
        cpu_state = tensors["torch_cpu"]
    except (SafetensorError, OSError, KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{path} is not a readable RNG state ({type(exc).__name__}: {exc}); the checkpoint "
                              "is damaged: use an earlier step_N") from None
    torch.set_rng_state(cpu_state)
    cuda = [tensors[f"cuda.{i}"] for i in range(len(tensors)) if f"cuda.{i}" in tensors]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    for name, generator in generators.items():
        if f"generator.{name}" in tensors:
            generator.set_state(tensors[f"generator.{name}"])
    return True
