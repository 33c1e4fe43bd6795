"""`phaserl doctor`: the preflight, without training.  One line per check: OK / WARN / FAIL → fix.

It covers the five classic mistakes (per-role parallel settings, the reward model's input
format, the frozen reference, per-phase batch sizes against this machine's memory, checkpoint and
log paths shared by every rank) and the rest of what breaks runs (config rules, data schema and
overlong prompts, chat template, tokenizer/model consistency, context length, rule rewards, one episode
of the configured agent environment, and the rollout/training log-prob mismatch on one sampled batch).

    cfg = load_doctor_config("cfg.yaml", ["rollout.n=8"])   # per-field checks only: the doctor reports the rest
    results = run_doctor(cfg, world_size=1)
    print(format_report(results)); sys.exit(1 if any_failed(results) else 0)

Under torchrun call `run_doctor` on every rank (the shared-path check is collective) and print on rank 0.
"""
from __future__ import annotations

from typing import Iterable

from ..config import Config
from .agent_probe import check_agent
from .checks import (
    Context,
    check_batch_sizes,
    check_config_rules,
    check_context,
    check_device,
    check_model,
    check_parallel_settings,
    check_shared_paths,
    check_tokenizer_model,
)
from .mismatch import check_mismatch
from .probes import (
    check_chat_template,
    check_data,
    check_memory,
    check_reference,
    check_reference_frozen,
    check_reward_functions,
    check_reward_model,
)
from .report import FAIL, OK, WARN, CheckResult, any_failed, format_failures, format_report
from .rollout_mode import check_rollout_mode
from .storage import check_write_paths
from .vision import check_vision_rows

# In order: config-only checks first, then what needs the device, the policy and the data.
CHECKS = (check_config_rules, check_parallel_settings, check_batch_sizes, check_rollout_mode, check_shared_paths,
          check_device, check_model, check_write_paths, check_tokenizer_model, check_context, check_data,
          check_chat_template, check_vision_rows, check_reward_functions, check_agent, check_reward_model,
          check_reference, check_memory, check_mismatch)


def run_doctor(cfg: Config, *, world_size: int = 1) -> list[CheckResult]:
    """Run every check on `cfg` for `world_size` ranks; never raises for a problem it can name."""
    ctx = Context(cfg=cfg, world_size=world_size)
    return [check(ctx) for check in CHECKS]


def load_doctor_config(path: str | None, overrides: Iterable[str] = ()) -> Config:
    """The config of `path` + overrides with per-field checks (types, ranges, unknown keys) but without the
    cross-field rules, so that the doctor can report each broken rule as its own line instead of stopping."""
    from ..config.load import apply_override, build, read_yaml

    cfg = build(Config, read_yaml(path) if path is not None else None, "", path or "default config")
    for text in overrides:
        apply_override(cfg, text)
    return cfg


__all__ = ["CHECKS", "CheckResult", "OK", "WARN", "FAIL", "run_doctor", "load_doctor_config", "format_report",
           "format_failures", "any_failed", "check_reference_frozen"]
