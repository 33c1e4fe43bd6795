"""GRPO step with LoRA: phaserl full vs LoRA r16 / r64, and phaserl LoRA vs TRL GRPOTrainer + PEFT LoRA, one run.

Each variant is one `benchmarks/grpo_step.py` process pair on one synthetic world per shape (so every
side's peak memory is its own): `full` runs ours alone with full fine-tuning (TRL full is grpo_step.py's
own comparison); `r16` / `r64` run ours with `actor.lora.rank=R, alpha=2R, target_modules=[all-linear]`
and TRL with `peft_config=LoraConfig(r=R, lora_alpha=2R, target_modules="all-linear")`, same prompts,
reward, sampling, KL (the reference is the base with adapters off on both sides), micro-batches and
optimizer settings as grpo_step.py lists. Prints every line grpo_step.py prints, then one
`measure=lora_compare` line per LoRA variant (s/step, peak memory, speed-up over TRL + PEFT, the issue's
targets) and a final `measure=lora_table` line.

    python benchmarks/lora_step.py --shape 0.5b --variants full,r16,r64 --ours-set actor.compile=true
    python benchmarks/lora_step.py --shape 7b --variants full --ours-set actor.compile=true --world /tmp/lora_world_7b
    python benchmarks/lora_step.py --shape 7b --variants r16 --ours-set actor.compile=true --world /tmp/lora_world_7b
    python benchmarks/lora_step.py --shape 7b --variants r64 --ours-set actor.compile=true --world /tmp/lora_world_7b
    python benchmarks/lora_step.py --smoke        # CPU: the tiny shape, every variant, both sides (minutes)

Needs trl, datasets and peft for the TRL side. Each grpo_step.py side process is bounded by --side-timeout;
at 7B one variant per command keeps a command within 10 minutes, and --world reuses the model written once.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = "lora_step"
TARGETS_7B = {"s_per_step_le": 8.0, "peak_gib_le": 55.0}  # issue 17: 7B LoRA r16
SPEEDUP_TARGET = 3.0


def emit(**record) -> None:
    print(json.dumps({"bench": BENCH, **record}), flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=["0.5b", "7b"], default="0.5b")
    p.add_argument("--smoke", action="store_true", help="grpo_step.py --tiny on the CPU: checks the script only")
    p.add_argument("--variants", default="full,r16,r64", help="comma-separated: full, rN (LoRA rank N)")
    p.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE", help="passed to grpo_step.py")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--side-timeout", type=float, default=280.0)
    p.add_argument("--world", default=None, help="a world directory made by grpo_step.py for this shape")
    return p.parse_args(argv)


def variant_argv(a, variant: str, world: str) -> list:
    """The grpo_step.py command of one variant."""
    argv = [sys.executable, os.path.join(HERE, "grpo_step.py"), "--world", world, "--steps", str(a.steps),
            "--warmup", str(a.warmup), "--warmup-trl", str(a.warmup), "--side-timeout", str(a.side_timeout)]
    argv += ["--tiny"] if a.smoke else ["--shape", a.shape]
    for item in a.ours_set:
        argv += ["--ours-set", item]
    if variant == "full":
        return argv + ["--only", "ours"]
    if not (variant.startswith("r") and variant[1:].isdigit() and int(variant[1:]) > 0):
        raise SystemExit(f"--variants: {variant!r} is neither 'full' nor 'rN' (a LoRA rank, e.g. r16)")
    return argv + ["--lora-rank", variant[1:], "--only", "both"]


def run_variant(argv: list) -> dict:
    """Run one grpo_step.py command, echo its lines, return {side: summary}."""
    summaries = {}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        print(line, end="", flush=True)
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("measure") == "summary":
                summaries[rec["side"]] = rec
    proc.wait()
    return summaries


def peak(summary: dict):
    return (summary.get("timed_peak") or {}).get("peak_allocated_gib")


def compare(a, variant: str, sums: dict) -> dict:
    ours, trl = sums.get("ours"), sums.get("trl")
    row = {"variant": variant, "ours_s_per_step": ours and ours["s_per_step_median"],
           "ours_peak_allocated_gib": ours and peak(ours),
           "ours_peak_reserved_gib": ours and (ours.get("timed_peak") or {}).get("peak_reserved_gib")}
    if variant == "full" or not (ours and trl and ours["s_per_step_median"] and trl["s_per_step_median"]):
        return row
    row.update(trl_peft_s_per_step=trl["s_per_step_median"], trl_peft_peak_allocated_gib=peak(trl),
               speedup=round(trl["s_per_step_median"] / ours["s_per_step_median"], 2))
    targets = {f"speedup_ge_{SPEEDUP_TARGET:g}x": row["speedup"] >= SPEEDUP_TARGET,
               "lower_peak_than_trl_peft": (peak(ours) or 0) < (peak(trl) or 0)}
    if a.shape == "7b" and not a.smoke and variant == "r16":
        targets.update(s_per_step_le_8=ours["s_per_step_median"] <= TARGETS_7B["s_per_step_le"],
                       peak_le_55_gib=(peak(ours) or 0) <= TARGETS_7B["peak_gib_le"])
    row["targets"] = targets
    emit(measure="lora_compare", shape="tiny" if a.smoke else a.shape, **row)
    return row


def main(argv=None) -> None:
    a = parse_args(argv)
    world = a.world or tempfile.mkdtemp(prefix=f"lora_step_{'tiny' if a.smoke else a.shape}_")
    rows = []
    for variant in [v.strip() for v in a.variants.split(",") if v.strip()]:
        sums = run_variant(variant_argv(a, variant, world))
        rows.append(compare(a, variant, sums))
    emit(measure="lora_table", shape="tiny" if a.smoke else a.shape, ours_set=a.ours_set, rows=rows)


if __name__ == "__main__":
    main()
