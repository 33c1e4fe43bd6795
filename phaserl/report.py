"""The run report: `{log_dir}/report.png`, four panels over steps, read from `{log_dir}/metrics.jsonl`.

Reward (train/reward_mean ± train/reward_std, the band clipped to the step's train/reward_min..max),
validation score (val/score_mean), KL (train/kl and actor/kl_loss: one curve when they are the same
numbers) and response length (train/response_length_mean, val/response_length_mean); every axis is
labelled and a caption says what this run's curves show (`caption`). Written at
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

PANELS = (  # (title, y-axis label, [(metric, legend label)])
    ("reward", "reward per response", [("train/reward_mean", "train reward (mean)")]),
    ("validation score", "score (held-out prompts)", [("val/score_mean", "val score (mean)")]),
    ("KL to the reference", "KL per token", [("train/kl", "train/kl (k3)"), ("actor/kl_loss", "actor/kl_loss")]),
    ("response length (tokens)", "tokens per response", [("train/response_length_mean", "train (mean)"),
                                                         ("val/response_length_mean", "val (mean)")]),
)
LENGTH_ADVICE = "response length should neither collapse to a few tokens nor sit at rollout.max_new_tokens"


def caption(records: list) -> str:
    """What this run's curves say, read from them (a fixed 'KL should grow slowly' would
    contradict the quickstart's own curve): reward against validation score, the KL against what the score did,
    the lengths."""
    reward, val = _change(records, "train/reward_mean"), _change(records, "val/score_mean")
    kl = series(records, "train/kl")[1] or series(records, "actor/kl_loss")[1]
    parts = []
    if reward and val:
        agree = (reward[1] > reward[0]) == (val[1] > val[0]) or abs(val[1] - val[0]) < 0.01
        parts.append(f"reward {reward[0]:.3g} -> {reward[1]:.3g} and validation score {val[0]:.3g} -> {val[1]:.3g}"
                     + (": they agree" if agree else ": the validation score does not follow the reward (reward "
                        "hacking or overfitting: check the reward function and the held-out data)"))
    elif reward:
        parts.append(f"reward {reward[0]:.3g} -> {reward[1]:.3g} (no validation logged: set data.val_files to see "
                     "whether it generalizes)")
    if kl:
        top = max(kl)
        step = series(records, "train/kl")[0] or series(records, "actor/kl_loss")[0]
        where = step[kl.index(top)]
        gained = val is not None and val[1] > val[0] + 0.01
        parts.append(f"KL to the reference up to {top:.3g} (step {where}), {kl[-1]:.3g} at the end"
                     + ("; the validation score rose with it, so the policy's move away from the reference paid"
                        if gained else "; with no gain on held-out prompts, a rising KL is the policy drifting: "
                        "lower the learning rate or raise algorithm.kl_coef"))
    parts.append(LENGTH_ADVICE)
    return "This run: " + "; ".join(parts) + "."


def _change(records: list, key: str) -> Optional[tuple]:
    """(first, last) of `key`: the mean of its first and last few points (one point: None)."""
    values = series(records, key)[1]
    if len(values) < 2:
        return None
    k = max(1, min(5, len(values) // 4))
    return sum(values[:k]) / k, sum(values[-k:]) / k


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
    last = max((r["step"] for r in records), default=0)
    fig = draw_report(records, f"phaserl run {os.path.abspath(log_dir)} — {last} steps")
    tmp = f"{out}.tmp.{os.getpid()}.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out)
    return out


def draw_report(records: list, title: str):
    """The report's matplotlib Figure: four panels with labelled axes and the caption under them."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    fig.suptitle(title)
    for ax, (panel, ylabel, keys) in zip(axes.flat, PANELS):
        drawn = []
        for key, label in keys:
            steps, values = series(records, key)
            twin = next((line for s, v, line in drawn if s == steps and _same(v, values)), None)
            if twin is not None:  # one curve per distinct quantity (on policy, train/kl is the update's kl_loss)
                twin.set_label(f"{twin.get_label()} = {label}")
                continue
            if not steps:
                continue
            (line,) = ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
            if key == "train/reward_mean":
                _band(ax, records, steps, values)
            drawn.append((steps, values, line))
        ax.set_title(panel)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes,
                    color="gray")
    fig.get_layout_engine().set(rect=(0, 0.07, 1, 0.93))  # room for the caption below the panels
    fig.text(0.01, 0.01, caption(records), fontsize=8, wrap=True, va="bottom", color="0.25")
    return fig


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-12 * max(1.0, abs(x)) for x, y in zip(a, b))


def _band(ax, records: list, steps: list, means: list) -> None:
    """mean ± std, clipped to the step's lowest and highest reward (train/reward_min/max) when logged."""
    by_step = {key: dict(zip(*series(records, key))) for key in ("train/reward_std", "train/reward_min",
                                                                  "train/reward_max")}
    stds = by_step["train/reward_std"]
    if all(s in stds and math.isfinite(stds[s]) for s in steps):
        low = [max(m - stds[s], by_step["train/reward_min"].get(s, -math.inf)) for s, m in zip(steps, means)]
        high = [min(m + stds[s], by_step["train/reward_max"].get(s, math.inf)) for s, m in zip(steps, means)]
        ax.fill_between(steps, low, high, alpha=0.2, label="spread of the step's responses: mean ± 1 std, "
                                                           "clipped to their lowest and highest")


def cli_report(argv: Optional[list] = None) -> int:
    """`phaserl report RUN_DIR`: write RUN_DIR/report.png and print its path."""
    p = argparse.ArgumentParser(prog="phaserl report", description="Plot a run's metrics.jsonl to report.png.")
    p.add_argument("run_dir", help="the run's trainer.log_dir (holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="where to write the PNG (default RUN_DIR/report.png)")
    args = p.parse_args(argv)
    print(f"report: {write_report(args.run_dir, args.out)}")
    return 0
