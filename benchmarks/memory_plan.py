"""The memory plan on the lent card: the plan phaserl chooses with nothing set, its predicted update peak against the
measured one, and the step time; and the long-response steps (1.5B at 32k, 7B at 16k) the plan makes fit.

Each run builds phaserl the way `phaserl train` does with no memory key set (grpo_step.py's config: one optimizer
step per batch, KL in the loss, ppo.micro_batch_tokens=auto; the memory plan is auto), prints the plan (one JSON line:
its choices with their reasons and its predicted peak), runs the steps and prints one line per step: seconds, and
the peak allocated memory of each phase (parallel.memory's timeline: the peak of every phase segment, so the
update's own peak is compared with the plan's prediction, which counts the update only). The summary line gives
the median step time, the update's measured peak, predicted / measured and whether it is within 10%.

    python benchmarks/memory_plan.py --shape 0.5b        # 64 x 8, 128 + 256: nothing planned (the defaults' path)
    python benchmarks/memory_plan.py --shape 1.5b        # 32 x 8, 256 + 1024
    python benchmarks/memory_plan.py --shape 7b          # 16 x 8, 256 + 512: on 80 GB the plan streams the reference
                                                         # and checkpoints layers; on 141 GB nothing
    python benchmarks/memory_plan.py --shape 1.5b --long --synthetic-rollout   # 8 x 8, 256 + 32768
    python benchmarks/memory_plan.py --shape 7b --long --synthetic-rollout     # 4 x 8, 256 + 16384
    python benchmarks/memory_plan.py --shape 7b --long --synthetic-rollout --set actor.offload_activations=true
                                  # the same with the checkpointed layers' inputs in host memory: its cost in step
                                  # time and what it frees of the update's peak, against the line above
    python benchmarks/memory_plan.py --shape 1.5b --synthetic-rollout --costs   # what each measure costs in speed
    python benchmarks/memory_plan.py --tiny              # a CPU smoke run (seconds)
    python benchmarks/memory_plan.py --shape 7b --card-gib 79.6   # on an H200: an H100 80 GB's memory

--long sets the long-response shapes (responses of exactly --new-tokens tokens: rollout.ignore_eos). Sampling 16k-32k
tokens one decode step at a time takes minutes per step; --synthetic-rollout puts random responses of the full
length in the place of the rollout phase (its two switches still run, so a kept engine's KV pool is there through
the update as in a real step), so that the phases the plan shapes (the reference's forward-only pass, the
old log-probs when there are, and the update) run as in a real step in a few minutes. --ab-plan off runs the same
step with the memory keys off (ref.stream_weights=false actor.checkpoint_layers=0 actor.optimizer_offload=false
actor.offload_activations=false) in a second process, for each measure's cost: where the plan was needed that side
is expected to run out of memory (its summary line then holds the error). --costs runs the step once per measure,
each in its own process at a shape where everything fits (1.5B on 80 GB): every memory key off, then each measure
alone forced on (COSTS: the reference streamed, all layers checkpointed, all checkpointed with their inputs offloaded,
AdamW on the CPU), and ends with a `costs` line: each one's step seconds, update peak and time against all-off.
Speed is never asserted: this prints.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grpo_setup  # noqa: E402
import grpo_step  # noqa: E402
from qwen2_shapes import SHAPES  # noqa: E402
from step_probes import memory_gib, reset_peak, sync  # noqa: E402

BENCH = "memory_plan"
GIB = 2**30
# shape -> (prompts, n, prompt tokens, new tokens); --long: the long-response shapes
STEP_SHAPES = {"0.5b": (64, 8, 128, 256), "1.5b": (32, 8, 256, 1024), "7b": (16, 8, 256, 512), "tiny": (4, 4, 16, 8)}
LONG_SHAPES = {"1.5b": (8, 8, 256, 32768), "7b": (4, 8, 256, 16384), "tiny": (2, 2, 16, 96)}
OFF = ["ref.stream_weights=false", "actor.checkpoint_layers=0", "actor.optimizer_offload=false",
       "actor.offload_activations=false"]
# --costs: each measure of the plan alone, the others off ("all": every layer of the shape, filled in per run)
COSTS = {"none": {}, "ref_streamed": {"ref.stream_weights": "true"},
         "all_checkpointed": {"actor.checkpoint_layers": "all"},
         "all_checkpointed_offloaded": {"actor.checkpoint_layers": "all", "actor.offload_activations": "true"},
         "optimizer_offloaded": {"actor.optimizer_offload": "true"}}


def emit(**record) -> None:
    print(json.dumps({"bench": BENCH, **record}), flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=["0.5b", "1.5b", "7b"], default="0.5b")
    p.add_argument("--tiny", action="store_true", help="CPU-sized model and batch (smoke test)")
    p.add_argument("--long", action="store_true", help="the long-response shape (1.5b: 32k, 7b: 16k new tokens)")
    p.add_argument("--synthetic-rollout", action="store_true",
                   help="random responses of the full length instead of sampling them (the phases after rollout run)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps first (1): the first step's update has no AdamW moments yet, so its peak is low")
    p.add_argument("--steps", type=int, default=None, help="timed steps (2; --long 1)")
    p.add_argument("--kv-fraction", type=float, default=None, help="rollout.engine_memory_fraction (default: 0.25, "
                   "0.4 with --long)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override")
    p.add_argument("--ab-plan", choices=["off"], default=None,
                   help="off: then the same step with the plan's keys off, in a second process")
    p.add_argument("--costs", action="store_true", help="each measure of the plan alone, in its own process, "
                   "against all of them off: its cost in step time (COSTS)")
    p.add_argument("--world", default=None, help="reuse this synthetic world directory")
    p.add_argument("--side-timeout", type=float, default=290.0, help="--ab-plan: seconds for the second process")
    p.add_argument("--card-gib", type=float, default=None,
                   help="make the card look this big (a second process holds the rest: card_size.py); e.g. 79.6 "
                        "for an H100 80 GB on an H200. Memory is then the smaller card's, speed is not")
    a = p.parse_args(argv)
    a.shape = "tiny" if a.tiny else a.shape
    a.prompts, a.n, a.prompt_len, a.new_tokens = (LONG_SHAPES if a.long else STEP_SHAPES)[a.shape]
    a.warmup = 1 if a.warmup is None else a.warmup
    a.steps = (1 if a.long else 2) if a.steps is None else a.steps
    a.kv_fraction = a.kv_fraction or (0.4 if a.long else 0.25)
    a.device = "cuda" if torch.cuda.is_available() else "cpu"
    # what grpo_step.ours_config reads: phaserl's own micro-batch (auto), its forward budget, no TRL side
    a.beta, a.lr, a.gradient_checkpointing, a.micro_batch, a.ours_micro_batch = 0.001, 1e-6, False, 1, "auto"
    a.forward_micro_batch, a.warmup_trl, a.steps_trl = None, 0, 0
    return a


def make_world(a) -> str:
    """grpo_step's synthetic world; the model's positions cover the long shapes (random weights: RoPE extends)."""
    root = a.world or tempfile.mkdtemp(prefix="memory_plan_")
    if os.path.isfile(os.path.join(root, "train.parquet")):
        return root
    from phaserl.models import CausalLM, DecoderConfig, save_pretrained

    t0 = time.perf_counter()
    tokenizer = grpo_setup.build_tokenizer(SHAPES[a.shape]["vocab_size"])
    cfg = DecoderConfig(model_type="qwen2", attention_bias=True, rope_theta=1e6, rms_norm_eps=1e-6,
                        max_position_embeddings=max(32768, 2 ** (a.prompt_len + a.new_tokens).bit_length()),
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **SHAPES[a.shape])
    torch.manual_seed(0)
    with torch.device(a.device):
        model = CausalLM(cfg)
    save_pretrained(model, os.path.join(root, "model"), dtype=torch.bfloat16)
    tokenizer.save_pretrained(os.path.join(root, "tokenizer"))
    del model
    count = a.prompts * (a.warmup + a.steps + 1)
    grpo_setup.write_prompt_file(root, grpo_setup.prompt_texts(count, a.prompt_len, SHAPES[a.shape]["vocab_size"]))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    emit(measure="world", dir=root, seconds=round(time.perf_counter() - t0, 1), shape=a.shape,
         positions=cfg.max_position_embeddings)
    return root


def build(a, root: str, extra: list):
    import yaml

    from phaserl.config import load_config
    from phaserl.trainer import RLTrainer

    log_dir = tempfile.mkdtemp(prefix="memory_plan_run_")
    config = grpo_step.ours_config(a, root, log_dir)
    config["rollout"]["ignore_eos"] = True  # every response is exactly --new-tokens long: the shape planned for
    path = os.path.join(log_dir, "run.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    t0 = time.perf_counter()
    trainer = RLTrainer.from_config(load_config(path, a.set + extra))
    speed = trainer.run.speed
    facts, plan = speed.memory if speed.memory is not None else (None, None)
    emit(measure="plan", shape=a.shape, long=a.long, overrides=a.set + extra,
         build_s=round(time.perf_counter() - t0, 1),
         plan=speed.memory_plan, choices=[c.line() for c in speed.all()],
         predicted_update_peak_gib=round(plan.peak_bytes / GIB, 2) if plan else None,
         budget_gib=round(plan.budget_bytes / GIB, 2) if plan else None, **memory_gib())
    return trainer, plan


def synthetic_rollout(trainer, a):
    """A batch of random responses of the full length, laid out as the rollout phase lays out its batch."""
    from phaserl.batch import RolloutBatch

    B, P, R = a.prompts * a.n, a.prompt_len, a.new_tokens
    device = trainer.actor.device
    V = trainer.actor.model.output_weight.shape[0]
    ids = torch.randint(2, V, (B, P + R), device=device)
    attn = torch.ones(B, P + R, dtype=torch.long, device=device)
    return RolloutBatch(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1),
                        response_mask=torch.ones(B, R, dtype=torch.long, device=device), prompt_width=P,
                        group_ids=torch.arange(B, device=device) // a.n,
                        rollout_logprobs=torch.full((B, R), -11.0, device=device), prompts=[""] * B,
                        response_texts=[""] * B, rows=[None] * B, finish_reasons=["length"] * B)


def synthetic_step(trainer, a) -> dict:
    """The phases after rollout on a synthetic batch: reference log-probs, old log-probs when needed, the update."""
    from phaserl.batch import TrainBatch
    from phaserl.parallel import set_phase

    run, batch = trainer.run, synthetic_rollout(trainer, a)
    timings = {}
    t = time.perf_counter()
    set_phase("rollout", trainer.step_num)
    with trainer.actor.rollout_mode():  # the rollout phase's two switches, no sampling: a kept engine (auto: on where
        pass                            # it fits) holds its KV pool through the update, as in a real step
    timings["rollout_switches"], t = time.perf_counter() - t, time.perf_counter()
    set_phase("forward", trainer.step_num)
    old = None if trainer._on_policy(batch) else trainer.actor.compute_logprobs(batch, token_budget=run.forward_tokens)
    ref = None if trainer.ref_policy is None else trainer.ref_policy.compute_logprobs(
        batch, temperature=run.temperature, token_budget=run.forward_tokens)
    sync()
    timings["forward"], t = time.perf_counter() - t, time.perf_counter()
    set_phase("update", trainer.step_num)
    advantages = torch.randn(batch.response_mask.shape, device=batch.input_ids.device)
    trainer.update(TrainBatch(batch, old, ref, advantages, advantages.clone(), None))
    sync()
    timings["update"] = time.perf_counter() - t
    return timings


def run(a, root: str, extra: list) -> dict:
    from phaserl.parallel.memory import mark_memory, record_memory, stop_recording

    trainer, plan = build(a, root, extra)
    steps = []
    for i in range(a.warmup + a.steps):
        reset_peak()
        record_memory(trainer.actor.device)  # every phase's own peak (a no-op off CUDA)
        sync()
        t0 = time.perf_counter()
        if a.synthetic_rollout:
            timings = synthetic_step(trainer, a)
        else:
            metrics = trainer.train_step()
            timings = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith("timing_s/")}
        sync()
        seconds = time.perf_counter() - t0
        trainer.step_num += 1
        mark_memory("end", trainer.step_num)
        phase_peaks = _phase_peaks(stop_recording())
        step = dict(measure="step", step=i, warmup=i < a.warmup, seconds=round(seconds, 2),
                    timing_s={k: round(v, 2) for k, v in timings.items()}, phase_peak_gib=phase_peaks,
                    tokens=a.prompts * a.n * (a.prompt_len + a.new_tokens), **memory_gib())
        steps.append(step)
        emit(**step)
    timed = [s for s in steps if not s["warmup"]] or steps
    measured = max((s["phase_peak_gib"].get("update") or 0.0) for s in timed)
    predicted = plan.peak_bytes / GIB if plan else None
    median = statistics.median(s["seconds"] for s in timed)
    record = dict(measure="summary", shape=a.shape, long=a.long, synthetic_rollout=a.synthetic_rollout,
                  overrides=a.set + extra, s_per_step_median=median,
                  tokens_per_s=round(timed[0]["tokens"] / median) if median else None,
                  predicted_update_peak_gib=round(predicted, 2) if predicted else None,
                  measured_update_peak_gib=measured or None, step_peak_allocated_gib=max(
                      s["peak_allocated_gib"] or 0 for s in timed) or None,
                  predicted_over_measured=round(predicted / measured, 3) if predicted and measured else None,
                  within_10pct=abs(predicted / measured - 1) <= 0.10 if predicted and measured else None,
                  plan=trainer.run.speed.memory_plan,
                  device=torch.cuda.get_device_name() if a.device == "cuda" else "cpu")
    emit(**record)
    return record


def _phase_peaks(samples: list) -> dict:
    """Phase -> the peak allocated GiB of its segment: each sample holds the peak since the one before, so a phase's
    peak is on the sample that follows the one that started it."""
    peaks = {}
    for start, end in zip(samples, samples[1:]):
        if not start.label.startswith("switch"):
            peaks[start.label] = round(max(peaks.get(start.label, 0.0), end.peak_gb), 2)
    return peaks


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.card_gib:
        from card_size import SmallerCard

        with SmallerCard(a.card_gib):
            _main(a, _without_card(argv or sys.argv[1:]))  # the --ab-plan side sees the held card already
        return
    _main(a, argv)


def _without_card(args: list) -> list:
    """The command line less --card-gib and its value."""
    out, skip = [], False
    for x in args:
        if skip or x.startswith("--card-gib="):
            skip = False
            continue
        if x == "--card-gib":
            skip = True
            continue
        out.append(x)
    return out


def cost_overrides(name: str, layers: int) -> list:
    """OFF with COSTS[name]'s keys set instead (checkpoint_layers "all" = the shape's layer count)."""
    keys = dict(x.split("=", 1) for x in OFF)
    keys.update({k: str(layers) if v == "all" else v for k, v in COSTS[name].items()})
    return [f"{k}={v}" for k, v in keys.items()]


def measure_costs(a, argv: list, root: str) -> None:
    """One process per COSTS entry (a fresh allocator each), their summaries in one `costs` line."""
    layers = SHAPES[a.shape]["num_hidden_layers"]
    base = [sys.executable, os.path.abspath(__file__), *[x for x in argv if x != "--costs"], "--world", root]
    costs = {}
    for name in COSTS:
        args = base + [f"--set={o}" for o in cost_overrides(name, layers)]
        try:
            done = subprocess.run(args, timeout=a.side_timeout, check=False, capture_output=True, text=True)
            out = done.stdout
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            out += json.dumps({"measure": "summary", "error": f"timed out after {a.side_timeout:.0f} s"}) + "\n"
        print(out, end="", flush=True)
        summary = [json.loads(x) for x in out.splitlines() if x.startswith("{") and '"summary"' in x]
        summary = summary[-1] if summary else {"error": f"no summary (exit {done.returncode}): "
                                                        f"{done.stderr.strip().splitlines()[-1:]}"}
        costs[name] = {k: summary.get(k) for k in ("s_per_step_median", "measured_update_peak_gib",
                                                   "step_peak_allocated_gib", "error") if summary.get(k) is not None}
    none = costs["none"].get("s_per_step_median")
    for name, c in costs.items():
        if none and c.get("s_per_step_median"):
            c["vs_none"] = round(c["s_per_step_median"] / none, 3)
    emit(measure="costs", shape=a.shape, long=a.long, synthetic_rollout=a.synthetic_rollout, costs=costs,
         device=torch.cuda.get_device_name() if a.device == "cuda" else "cpu")


def _main(a, argv) -> None:
    root = make_world(a)
    if a.costs:
        measure_costs(a, list(argv or sys.argv[1:]), root)
        return
    if a.ab_plan:
        run(a, root, [])
        args = [sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:]), "--world", root]
        args = [x for x in args if x not in ("--ab-plan", "off")]
        try:
            subprocess.run(args + [f"--set={o}" for o in OFF], timeout=a.side_timeout, check=False)
        except subprocess.TimeoutExpired:
            emit(measure="summary", overrides=OFF, error=f"timed out after {a.side_timeout:.0f} s")
        return
    try:
        run(a, root, [])
    except Exception as exc:  # noqa: BLE001 - an out-of-memory stop of the plan-off side is a result
        emit(measure="summary", overrides=a.set, error=f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
        print(exc, file=sys.stderr)


if __name__ == "__main__":
    main()
