"""Metric sinks: the console line, `{log_dir}/metrics.jsonl`, TensorBoard and (optionally) wandb.

Only rank 0 writes. Names are stable (see docs/metrics.md): `train/reward_mean`, `timing_s/step`,
`perf/tokens_per_s`, `val/score_mean`, ... One JSON object per line, with `step` first.
"""
from __future__ import annotations

import json
import logging
import math
import os
from typing import Optional

log = logging.getLogger("phaserl")

CONSOLE_KEYS = (("train/reward_mean", "reward"), ("val/score_mean", "val"), ("actor/kl_loss", "kl_loss"),
                ("train/kl", "kl"), ("train/response_length_mean", "len"), ("actor/entropy", "entropy"),
                ("timing_s/step", "s/step"), ("perf/tokens_per_s", "tok/s"))


def _plain(value):
    """A JSON-safe scalar (NaN/inf become strings so the file stays valid JSON)."""
    value = float(value) if not isinstance(value, (int, str, bool)) else value
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLogger:
    def __init__(self, log_dir: str, loggers: list, *, rank: int = 0, run_name: Optional[str] = None,
                 config: Optional[dict] = None):
        self.enabled = rank == 0
        self.log_dir = log_dir
        self.loggers = set(loggers)
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not self.enabled:
            return
        os.makedirs(log_dir, exist_ok=True)
        if "jsonl" in self.loggers:
            self._jsonl = open(os.path.join(log_dir, "metrics.jsonl"), "a", encoding="utf-8")
        if "wandb" in self.loggers:
            self._wandb = _start_wandb(run_name, config)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is None and "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            # Opened at the first logged step: events a killed run wrote from this step on are purged,
            # so a resumed run's curves match metrics.jsonl (which the resume cut the same way).
            self._tb = SummaryWriter(log_dir=self.log_dir, purge_step=step)
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if "console" in self.loggers:
            log.info(console_line(step, metrics))

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def console_line(step: int, metrics: dict) -> str:
    parts = [f"step {step}"]
    for key, short in CONSOLE_KEYS:
        if key in metrics:
            parts.append(f"{short} {metrics[key]:.4g}")
    return " | ".join(parts)


def _start_wandb(run_name, config):
    try:
        import wandb
    except ImportError:
        log.warning("trainer.loggers has 'wandb' but wandb is not installed: `pip install wandb`; continuing without it")
        return None
    return wandb.init(project="phaserl", name=run_name, config=config)
