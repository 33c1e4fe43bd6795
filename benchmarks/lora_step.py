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
    python benchmarks/lora_step.py --floor --shape 7b   # no GPU: each phase's lower bound (FLOPs / rate, bytes / bw)

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
sys.path.insert(0, HERE)
BENCH = "lora_step"
TARGETS_7B = {"s_per_step_le": 8.0, "peak_gib_le": 55.0}  # the 7B LoRA r16 target
SPEEDUP_TARGET = 3.0


def emit(**record) -> None:
    print(json.dumps({"bench": BENCH, **record}), flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=["0.5b", "7b"], default="0.5b")
    p.add_argument("--smoke", action="store_true", help="grpo_step.py --tiny on the CPU: checks the script only")
    p.add_argument("--variants", default="full,r16,r64", help="comma-separated: full, rN (LoRA rank N, both sides), "
                   "rN:ours (phaserl alone)")
    p.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE", help="passed to grpo_step.py")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--side-timeout", type=float, default=280.0)
    p.add_argument("--world", default=None, help="a world directory made by grpo_step.py for this shape")
    p.add_argument("--floor", action="store_true", help="print each phase's lower bound at --shape and exit")
    p.add_argument("--rank", type=int, default=16, help="--floor: the LoRA rank")
    p.add_argument("--matmul-tflops", type=float, default=650.0, help="--floor: bf16 matmul rate reached at "
                   "these shapes (H200: 782-786 measured at 8192^3, ~650 at the step's own shapes)")
    p.add_argument("--hbm-tbs", type=float, default=4.26, help="--floor: memory bandwidth (H200 D2D copy, measured)")
    return p.parse_args(argv)


# The shapes' sequences: prompts x n responses of prompt_len + new_tokens (grpo_step.py's --shape sizes).
SEQUENCES = {"0.5b": (64, 8, 128, 256), "7b": (16, 8, 256, 512)}


def step_floor(shape: str, rank: int, matmul_tflops: float, hbm_tbs: float) -> dict:
    """Seconds no implementation can beat, per phase of the GRPO step at `shape` (KL on: a reference pass).

    FLOPs are 2 per multiply-add over every token (prompt + response) through the decoder's linear layers,
    the LM head on response tokens only, causal attention (2 Hq D S^2 per layer and sequence forward, 2.5x
    that backward), the adapters (2 r (in + out) per token and target). ref = forward; LoRA update =
    forward + activation gradients (no weight gradient for the frozen base); full update adds the weight
    gradients. Rollout: one decode step per new token for all sequences at once (all in slots), each
    reading every weight but the embedding once plus the KV of its context (mean prompt + new/2), and
    doing 2 x params x sequences FLOPs: the larger of bytes / bandwidth and FLOPs / rate; plus the prefill
    of the distinct prompts. No recomputation, no launch gaps, no optimizer step (AdamW on LoRA is tiny).
    """
    from qwen2_shapes import SHAPES

    c = SHAPES[shape]
    H, L, inter, V = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    Hq, Hkv = c["num_attention_heads"], c["num_key_value_heads"]
    D = H // Hq
    prompts, n, P, R = SEQUENCES[shape]
    B, S = prompts * n, P + R
    linear = L * (H * Hq * D + 2 * H * Hkv * D + Hq * D * H + 3 * H * inter)  # decoder linear weights
    adapters = L * rank * ((H + Hq * D) + 2 * (H + Hkv * D) + (Hq * D + H) + 2 * (H + inter) + (inter + H))
    tokens = B * S
    forward = 2 * linear * tokens + 2 * H * V * B * R + L * B * 2 * Hq * D * S * S  # FLOPs
    lora_fwd = 2 * adapters * tokens
    backward_acts = 2 * linear * tokens + 2 * H * V * B * R + 2.5 * L * B * 2 * Hq * D * S * S
    weight_grads = 2 * linear * tokens + 2 * H * V * B * R
    rate, bw = matmul_tflops * 1e12, hbm_tbs * 1e12
    kv_per_token = 2 * L * Hkv * D * 2  # bf16 keys + values
    step_bytes = 2 * (linear + H * V) + B * (P + R / 2) * kv_per_token
    step_flops = 2 * (linear + H * V) * B
    rollout = R * max(step_bytes / bw, step_flops / rate) + 2 * linear * prompts * P / rate
    lora = {"rollout": rollout, "forward": forward / rate,
            "update": (forward + lora_fwd + backward_acts + 2 * lora_fwd) / rate}
    full = {"rollout": rollout, "forward": forward / rate, "update": (forward + backward_acts + weight_grads) / rate}
    return {"shape": shape, "sequences": B, "tokens": tokens, "matmul_tflops": matmul_tflops, "hbm_tbs": hbm_tbs,
            "decode_step_ms": round(1e3 * max(step_bytes / bw, step_flops / rate), 3),
            "decode_step_gb": round(step_bytes / 1e9, 2), "decoder_linear_params": linear, "adapter_params": adapters,
            "lora": {**{k: round(v, 3) for k, v in lora.items()}, "step": round(sum(lora.values()), 3)},
            "full": {**{k: round(v, 3) for k, v in full.items()}, "step": round(sum(full.values()), 3)}}


def variant_argv(a, variant: str, world: str) -> list:
    """The grpo_step.py command of one variant."""
    argv = [sys.executable, os.path.join(HERE, "grpo_step.py"), "--world", world, "--steps", str(a.steps),
            "--warmup", str(a.warmup), "--warmup-trl", str(a.warmup), "--side-timeout", str(a.side_timeout)]
    argv += ["--tiny"] if a.smoke else ["--shape", a.shape]
    for item in a.ours_set:
        argv += ["--ours-set", item]
    if variant == "full":
        return argv + ["--only", "ours"]
    rank, _, side = variant.partition(":")
    if not (rank.startswith("r") and rank[1:].isdigit() and int(rank[1:]) > 0 and side in ("", "ours")):
        raise SystemExit(f"--variants: {variant!r} is neither 'full' nor 'rN' / 'rN:ours' (a LoRA rank, e.g. r16; "
                         ":ours leaves TRL + PEFT out)")
    return argv + ["--lora-rank", rank[1:], "--only", side or "both"]


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
    if a.floor:
        emit(measure="floor", rank=a.rank, **step_floor(a.shape, a.rank, a.matmul_tflops, a.hbm_tbs))
        return
    world = a.world or tempfile.mkdtemp(prefix=f"lora_step_{'tiny' if a.smoke else a.shape}_")
    rows = []
    for variant in [v.strip() for v in a.variants.split(",") if v.strip()]:
        sums = run_variant(variant_argv(a, variant, world))
        rows.append(compare(a, variant, sums))
    emit(measure="lora_table", shape="tiny" if a.smoke else a.shape, ours_set=a.ours_set, rows=rows)


if __name__ == "__main__":
    main()
