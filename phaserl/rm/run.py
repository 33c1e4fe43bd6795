"""`run_train_rm(cfg)`: what `phaserl train-rm` does once its config's names are resolved.

Reads the preference pairs, trains (train.py), exports the model to {out_dir}/model and writes
{out_dir}/train_rm_stats.json. The names in the config ('tiny', device 'auto') are resolved before
this, by `phaserl.resolve.resolve_rm_config`; argument parsing is the CLI's (`phaserl.cli`).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict

from phaserl.rm.config import RMTrainConfig
from phaserl.rm.train import RMTrainStats, train_reward_model

log = logging.getLogger("phaserl")


def run_train_rm(cfg: RMTrainConfig) -> RMTrainStats:
    """Read pairs, train, export to {out_dir}/model; `cfg` is resolved (no 'tiny', no device 'auto')."""
    from phaserl.data import load_preference_rows
    from phaserl.models import load_tokenizer

    assert cfg.device != "auto" and "tiny" not in (cfg.model_path, *cfg.train_files, *cfg.val_files), \
        "run_train_rm takes a resolved config: phaserl.resolve.resolve_rm_config(cfg)"
    tokenizer = load_tokenizer(cfg.tokenizer_path or cfg.model_path)
    train_rows = load_preference_rows(cfg.train_files)
    val_rows = load_preference_rows(cfg.val_files)
    log.info(f"[train-rm] {len(train_rows)} training pairs, {len(val_rows)} held-out pairs; init from {cfg.model_path}")
    stats = train_reward_model(
        cfg.model_path, tokenizer, train_rows, val_rows, steps=cfg.steps, lr=cfg.lr, batch_size=cfg.batch_size,
        max_length=cfg.max_length, apply_chat_template=cfg.apply_chat_template, chat_template=cfg.chat_template,
        truncation_side=cfg.truncation_side, seed=cfg.seed, device=cfg.device,
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
