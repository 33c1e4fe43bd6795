"""Reward models end to end: Bradley–Terry training, the tiny world's preference pairs, critic init.

    config.py       RMTrainConfig + load_rm_config (the YAML of `phaserl train-rm`)
    train.py        train_reward_model, evaluate_pairs, SequenceScorer (our decoder as an RM), export
    tiny_prefs.py   preference pairs from the tiny arithmetic world (correct vs near-miss answers)
    critic_init.py  init_critic("policy" | "reward_model", path): where the PPO critic starts
    this file       run_train_rm(cfg), `phaserl train-rm [CFG] [key=value ...]`, and the built-in tiny RM
                    ('tiny' as a reward-model path: trained on first use, then reused)

Scoring with a trained RM during RL is `phaserl.roles.RewardModelWrapper` (reward_model.* in the RL config).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import asdict
from typing import Optional

from phaserl.rm.config import RMTrainConfig, load_rm_config
from phaserl.rm.critic_init import CRITIC_SOURCES, init_critic, is_reward_model_dir
from phaserl.rm.tiny_prefs import make_tiny_preference_records, write_tiny_preference_files
from phaserl.rm.train import (PairAccuracy, RMTrainStats, SequenceScorer, evaluate_pairs, export_reward_model,
                              train_reward_model)

log = logging.getLogger("phaserl")
TINY = "tiny"

__all__ = ["RMTrainConfig", "load_rm_config", "CRITIC_SOURCES", "init_critic", "is_reward_model_dir",
           "make_tiny_preference_records", "write_tiny_preference_files", "PairAccuracy", "RMTrainStats",
           "SequenceScorer", "evaluate_pairs", "export_reward_model", "train_reward_model", "run_train_rm",
           "cli_train_rm", "prepare_tiny_reward_model", "resolve_reward_model_path"]


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        from phaserl.errors import ConfigError

        raise ConfigError("device = cuda but no CUDA device is visible; use device=cpu")
    return name


def _files(files: list[str], which: str, cfg: RMTrainConfig) -> list[str]:
    """'tiny' entries become the generated tiny-world pair files under {out_dir}/data."""
    if TINY not in files:
        return files
    train, val = write_tiny_preference_files(os.path.join(cfg.out_dir, "data"), n_train=cfg.tiny_train_pairs,
                                             n_val=cfg.tiny_val_pairs, seed=cfg.seed)
    return [(train if which == "train" else val) if f == TINY else f for f in files]


def run_train_rm(cfg: RMTrainConfig) -> RMTrainStats:
    """Everything `phaserl train-rm` does: resolve paths, read pairs, train, export to {out_dir}/model."""
    from phaserl.data import load_preference_rows
    from phaserl.models import load_tokenizer

    model_path = cfg.model_path
    if model_path == TINY:
        from phaserl.world import prepare_tiny_world

        model_path = prepare_tiny_world().model_dir
    tokenizer = load_tokenizer(cfg.tokenizer_path or model_path)
    train_rows = load_preference_rows(_files(cfg.train_files, "train", cfg))
    val_rows = load_preference_rows(_files(cfg.val_files, "val", cfg))
    log.info(f"[train-rm] {len(train_rows)} training pairs, {len(val_rows)} held-out pairs; init from {model_path}")
    stats = train_reward_model(
        model_path, tokenizer, train_rows, val_rows, steps=cfg.steps, lr=cfg.lr, batch_size=cfg.batch_size,
        max_length=cfg.max_length, apply_chat_template=cfg.apply_chat_template, chat_template=cfg.chat_template,
        truncation_side=cfg.truncation_side, seed=cfg.seed, device=_device(cfg.device),
        out_dir=os.path.join(cfg.out_dir, "model"), weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps,
        grad_clip=cfg.grad_clip, log_every=cfg.log_every)
    summary = {k: v for k, v in asdict(stats).items() if k not in ("losses", "accuracies")}
    with open(os.path.join(cfg.out_dir, "train_rm_stats.json"), "w") as f:
        json.dump({**summary, "losses": stats.losses}, f, indent=1)
    before = f"{stats.val_before.accuracy:.3f}" if stats.val_before else "n/a"
    after = f"{stats.val_after.accuracy:.3f}" if stats.val_after else "n/a"
    log.info(f"[train-rm] held-out pairwise accuracy {before} -> {after} ({len(val_rows)} pairs) in "
             f"{stats.seconds:.0f} s; reward model written to {stats.out_dir}")
    return stats


def cli_train_rm(argv: list[str]) -> int:
    """`phaserl train-rm [CFG] [key=value ...]`; errors are raised as phaserl errors for the CLI to print."""
    parser = argparse.ArgumentParser(prog="phaserl train-rm",
                                     description="Train a Bradley-Terry reward model on preference pairs and "
                                                 "export it as a Hugging Face sequence-classification directory.")
    parser.add_argument("args", nargs="*", metavar="[CFG] [key=value ...]",
                        help="a train-rm YAML file (optional: the defaults train the tiny-world RM), then overrides")
    parsed = parser.parse_args(argv)
    path = parsed.args[0] if parsed.args and "=" not in parsed.args[0] else None
    overrides = parsed.args[1:] if path is not None else parsed.args
    run_train_rm(load_rm_config(path, overrides))
    return 0


def resolve_reward_model_path(path: Optional[str]) -> Optional[str]:
    """'tiny' names the built-in tiny-world reward model; any other path (or None) is returned as it is."""
    return prepare_tiny_reward_model() if path == TINY else path


# RMTrainConfig's defaults, with inputs capped at the tiny model's 64 positions (its inputs are ~25 tokens)
_TINY_RECIPE = RMTrainConfig(max_length=64)


def prepare_tiny_reward_model(root: Optional[str] = None) -> str:
    """The tiny world's reward model directory: trained with `_TINY_RECIPE` on first use (CPU,
    under a minute) into `root` (default ~/.cache/phaserl/tiny-rm, next to the tiny world's data cache),
    and reused while the tiny world's model and the recipe stay the same."""
    from phaserl.world import prepare_tiny_world
    from phaserl.world.build import default_root

    policy_dir = prepare_tiny_world().model_dir
    root = str(root or default_root().parent / "tiny-rm")
    model_dir, stamp = os.path.join(root, "model"), os.path.join(root, "init_fingerprint.txt")
    fingerprint = _fingerprint(policy_dir)
    if os.path.isfile(stamp) and os.path.isfile(os.path.join(model_dir, "config.json")):
        with open(stamp) as f:
            if f.read().strip() == fingerprint:
                return model_dir
    log.info(f"[train-rm] training the built-in tiny reward model into {root} (first use; about a minute on a CPU)")
    run_train_rm(dataclasses.replace(_TINY_RECIPE, model_path=policy_dir, out_dir=root, device="cpu"))
    with open(stamp, "w") as f:
        f.write(fingerprint + "\n")
    return model_dir


def _fingerprint(model_dir: str) -> str:
    """sha256 of the init model's weights and of the RM recipe: a change to either retrains the tiny RM."""
    digest = hashlib.sha256(json.dumps(asdict(_TINY_RECIPE), sort_keys=True).encode())
    with open(os.path.join(model_dir, "model.safetensors"), "rb") as f:
        digest.update(f.read())
    return digest.hexdigest()
