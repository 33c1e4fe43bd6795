"""The run report: `{log_dir}/report.png`, four panels over steps, read from `{log_dir}/metrics.jsonl`.

Reward (train/reward_mean ± train/reward_std), validation score (val/score_mean), KL (train/kl and
actor/kl_loss) and response length (train/response_length_mean, val/response_length_mean). Written at
the end of `fit` on rank 0 and by `phaserl report RUN_DIR`. matplotlib draws off-screen (Agg); the file
is replaced atomically. Not here: live dashboards (TensorBoard reads the same run directory).
"""
from __future__ import annotations

import argparse
import json
import math
import os
from typing import Optional

from .errors import DataError

PANELS = (  # (title, [(metric, label)])
    ("reward", [("train/reward_mean", "train reward (mean)")]),
    ("validation score", [("val/score_mean", "val score (mean)")]),
    ("KL to the reference", [("train/kl", "train/kl (k3, rollout)"), ("actor/kl_loss", "actor/kl_loss")]),
    ("response length (tokens)", [("train/response_length_mean", "train (mean)"),
                                  ("val/response_length_mean", "val (mean)")]),
)


def read_metrics(path: str) -> list:
    """The JSON objects of metrics.jsonl, one per line (a last line cut short by a crash is skipped)."""
    if not os.path.isfile(path):
        raise DataError(f"{path} does not exist; RUN_DIR must be a run's trainer.log_dir (the directory that "
                        "holds metrics.jsonl; 'jsonl' must be in trainer.loggers)")
    records = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if i == len(lines):
                break                     # killed mid-write
            raise DataError(f"{path}, line {i}: not valid JSON ({exc}); was the file edited by hand?") from None
    return records


def series(records: list, key: str) -> tuple[list, list]:
    """(steps, values) of `key`, skipping records without it; "nan"/"inf" strings become floats."""
    steps, values = [], []
    for r in records:
        if key in r and isinstance(r[key], (int, float, str)):
            try:
                value = float(r[key])
            except ValueError:
                continue
            steps.append(r["step"])
            values.append(value)
    return steps, values


def write_report(log_dir: str, out: Optional[str] = None) -> str:
    """Draw report.png from `{log_dir}/metrics.jsonl`; returns the path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(os.path.join(log_dir, "metrics.jsonl"))
    out = out or os.path.join(log_dir, "report.png")
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    last = max((r["step"] for r in records), default=0)
    fig.suptitle(f"phaserl run {os.path.abspath(log_dir)} — {last} steps")
    for ax, (title, keys) in zip(axes.flat, PANELS):
        drawn = False
        for key, label in keys:
            steps, values = series(records, key)
            if not steps:
                continue
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
            if key == "train/reward_mean":
                _band(ax, records, steps, values)
            drawn = True
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes,
                    color="gray")
    tmp = f"{out}.tmp.{os.getpid()}.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out)
    return out


def _band(ax, records: list, steps: list, means: list) -> None:
    std_steps, stds = series(records, "train/reward_std")
    by_step = dict(zip(std_steps, stds))
    if all(s in by_step and math.isfinite(by_step[s]) for s in steps):
        lo = [m - by_step[s] for s, m in zip(steps, means)]
        hi = [m + by_step[s] for s, m in zip(steps, means)]
        ax.fill_between(steps, lo, hi, alpha=0.2, label="± std")


def cli_report(argv: Optional[list] = None) -> int:
    """`phaserl report RUN_DIR`: write RUN_DIR/report.png and print its path."""
    p = argparse.ArgumentParser(prog="phaserl report", description="Plot a run's metrics.jsonl to report.png.")
    p.add_argument("run_dir", help="the run's trainer.log_dir (holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="where to write the PNG (default RUN_DIR/report.png)")
    args = p.parse_args(argv)
    print(f"report: {write_report(args.run_dir, args.out)}")
    return 0
