"""The tiny world's reward model: trained on first use, then reused.

`prepare_tiny_reward_model()` is what 'tiny' as a reward-model path resolves to
(`phaserl.resolve.resolve_reward_model_path`). It trains `_TINY_RECIPE` (RMTrainConfig's defaults with
inputs capped at the tiny model's 64 positions) on tiny-world pairs, on the CPU, in under a minute,
and retrains only when the tiny world's model or the recipe changes.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import asdict
from typing import Optional

from phaserl.rm.config import RMTrainConfig
from phaserl.rm.run import run_train_rm
from phaserl.rm.tiny_prefs import write_tiny_preference_files

log = logging.getLogger("phaserl")

# RMTrainConfig's defaults, with inputs capped at the tiny model's 64 positions (its inputs are ~25 tokens)
_TINY_RECIPE = RMTrainConfig(max_length=64)


def prepare_tiny_reward_model(root: Optional[str] = None) -> str:
    """The tiny world's reward model directory: trained with `_TINY_RECIPE` on first use (CPU,
    under a minute) into `root` (default $PHASERL_CACHE_DIR/tiny-rm, ~/.cache/phaserl/tiny-rm when unset),
    and reused while the tiny world's model and the recipe stay the same."""
    from phaserl.world import prepare_tiny_world
    from phaserl.world.build import cache_root

    policy_dir = prepare_tiny_world().model_dir
    root = str(root or cache_root() / "tiny-rm")
    model_dir, stamp = os.path.join(root, "model"), os.path.join(root, "init_fingerprint.txt")
    fingerprint = _fingerprint(policy_dir)
    if os.path.isfile(stamp) and os.path.isfile(os.path.join(model_dir, "config.json")):
        with open(stamp) as f:
            if f.read().strip() == fingerprint:
                return model_dir
    log.info(f"[train-rm] training the built-in tiny reward model into {root} (first use; about a minute on a CPU)")
    r = _TINY_RECIPE
    train, val = write_tiny_preference_files(os.path.join(root, "data"), n_train=r.tiny_train_pairs,
                                             n_val=r.tiny_val_pairs, seed=r.seed)
    run_train_rm(dataclasses.replace(r, model_path=policy_dir, out_dir=root, device="cpu",
                                     train_files=[train], val_files=[val]))
    with open(stamp, "w") as f:
        f.write(fingerprint + "\n")
    return model_dir


def _fingerprint(model_dir: str) -> str:
    """sha256 of the init model's weights and of the RM recipe: a change to either retrains the tiny RM."""
    digest = hashlib.sha256(json.dumps(asdict(_TINY_RECIPE), sort_keys=True).encode())
    with open(os.path.join(model_dir, "model.safetensors"), "rb") as f:
        digest.update(f.read())
    return digest.hexdigest()
