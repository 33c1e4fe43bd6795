"""Several GPUs of one host: correctness, scaling and the hybrid switch, all in one call.

    python benchmarks/multi_gpu.py                  # on a 2- or 4-GPU machine: every part, ~10 min at most
    python benchmarks/multi_gpu.py --smoke          # CPU, 2 gloo ranks, tiny shapes (the test runs this)
    python benchmarks/multi_gpu.py --parts world,scaling,scaling_variants   # a second call: what the budget cut

The driver starts `torchrun --standalone --nproc-per-node N benchmarks/multi_gpu_ranks.py JOB ...` (or one plain
process, on GPU 0 alone, for the 1-rank references) once per launch, each under its own timeout, in the
priority order below, and stops starting launches when --budget seconds are spent. It prints one compact JSON
line per result (`part` names which) as soon as it has it (whole in OUT/results.jsonl, shortened on stdout);
every raw line of every launch goes to OUT/raw.jsonl and each launch's stderr to OUT/logs/. Parts, in priority order:

  world        the synthetic worlds (multi_gpu_ranks.py world)
  correctness  per scenario (grpo, ppo_rm: PPO + critic + FULL_SHARD reward model, grpo_lora, grpo_mistral,
               grpo_gemma3, grpo_moe_replay: Qwen3-MoE with routing replay): one RL step on N ranks against 1
               rank: the same responses, loss and grad norm within TOLERANCE, and the weight update pointing the
               same way (cosine of the two updates)
  checkpoint   save on N ranks -> resume on 1 -> resume on N: each resume restores exactly the weights saved,
               and the end equals the uninterrupted N-rank run's within TOLERANCE
  scaling      grpo_step.py's GRPO step at --shape 1.5b (32 prompts x 8 per GPU, prompt 256, 1024 new tokens) on
               1, 2 (and 4) GPUs with phaserl's auto settings; the per-GPU efficiency against 1 GPU (target 0.85)
  switch       each [HybridEngine] switch at 0.5B on N GPUs (FULL_SHARD, + offload_optimizer, NO_SHARD +
               keep_awake): seconds per step, one switch pair under torch.profiler (gathers, copies,
               allocation, syncs), and the engine's begin seconds / CUDA graph count per step
  scaling_variants  the 1.5B step on N GPUs with other settings (actor.compile=true; NO_SHARD + keep_awake):
               the "best settings per world size" search, last because the budget may not reach it

TOLERANCE (bf16 on GPUs; the CPU smoke runs float32 against the same bounds): a metric agrees when
|a - b| <= 2e-2 * max(|a|, |b|) + 1e-3 (bf16 keeps 8 mantissa bits, 3.9e-3 per rounding, and the ranks sum
in another order); the update agrees when the cosine of (after - before) between the runs is >= 0.99.
Element-wise weight bounds mean little after one AdamW step (its first step is about lr * sign(grad) for
every weight, whatever the gradient's size), so max |delta w| is reported next to the step size, not bounded.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = os.path.join(HERE, "multi_gpu_ranks.py")
METRIC_REL, METRIC_ABS, UPDATE_COS = 2e-2, 1e-3, 0.99
EFFICIENCY_TARGET = 0.85
KEYS = {"grpo": ("train/reward_mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy"),
        "ppo_rm": ("train/reward_mean", "critic/vf_loss", "critic/grad_norm", "actor/pg_loss", "actor/grad_norm"),
        "grpo_lora": ("train/reward_mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss"),
        "grpo_mistral": ("train/reward_mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss"),
        "grpo_gemma3": ("train/reward_mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss"),
        "grpo_moe_replay": ("train/reward_mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "mismatch/k3")}
PART_NAMES = ("world", "correctness", "scaling", "switch", "scaling_variants")  # correctness includes checkpoint
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


RESULTS = []  # the open OUT/results.jsonl, once main() has made it
BULKY = ("top_host", "speed", "overrides", "s_per_step_all", "warmup_seconds", "peak_reserved_gib_per_gpu")


def emit(**record) -> None:
    """A result: whole in OUT/results.jsonl, on stdout without its bulky keys (a device call returns only the
    tail of stdout)."""
    record = {"bench": "multi_gpu", **record}
    for f in RESULTS:
        f.write(json.dumps(record) + "\n")
        f.flush()
    print(json.dumps({k: v for k, v in record.items() if k not in BULKY}), flush=True)


# ----- launching --------------------------------------------------------------------------------
class Driver:
    """Runs launches under per-launch timeouts within one overall budget; keeps every raw line."""

    def __init__(self, a):
        self.a, self.t0 = a, time.monotonic()
        self.root = a.work  # models, prompt files, checkpoints: never under OUT (a device call copies OUT back)
        os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
        self.raw = open(os.path.join(a.out, "raw.jsonl"), "a")
        self.status: dict = {}  # part -> ok | failed | timeout | skipped
        self.worlds = [w for w in (1, 2, 4, 8) if w <= a.gpus]  # 1 = the reference; worlds[1] = 2 = "N" below
        self.scaling: dict = {}  # (world, settings label) -> the scaling line

    def scale_args(self, world: int, label: str, settings=()) -> list:
        return ["--prompts", str(self.a.prompts), "--steps", str(self.a.steps), "--warmup", str(self.a.warmup),
                "--label", label, *[x for s in settings for x in ("--set", s)]]

    def left(self) -> float:
        return self.a.budget - (time.monotonic() - self.t0)

    def launch(self, part: str, label: str, nproc: int, jobs: list, extra: list, timeout_s: float):
        """One launch of the rank program; returns its JSON records, or None when it failed or was not started."""
        a = self.a
        limit = min(timeout_s, self.left() - 5)
        if limit < 15:
            emit(part=part, measure="skipped", launch=label, reason=f"{self.left():.0f} s of --budget left")
            self.status.setdefault(part, "skipped")
            return None
        program = [RANKS, *jobs, "--root", self.root, "--device", a.device, *(["--smoke"] if a.smoke else []), *extra]
        env = dict(os.environ, **({} if a.smoke else NCCL_ENV))
        if nproc == 1:
            argv = [sys.executable, *program]
            if not a.smoke:
                env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
            env.pop("WORLD_SIZE", None)
        else:
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                    *program]
        log_path = os.path.join(a.out, "logs", f"{part}-{label}.log")
        t0 = time.monotonic()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                                    start_new_session=True)
            timer = threading.Timer(limit, _stop, args=(proc,))
            timer.start()
            records = []
            try:
                for line in proc.stdout:
                    self.raw.write(line)
                    self.raw.flush()
                    if line.startswith("{"):
                        try:
                            records.append(json.loads(line))
                        except json.JSONDecodeError:
                            pass
                proc.wait()
            finally:
                timer.cancel()
        seconds = round(time.monotonic() - t0, 1)
        if proc.returncode != 0:
            timed_out = seconds >= limit - 1
            with open(log_path) as f:
                text = f.read()
            first = text.find("Traceback (most recent call last)")  # the root cause, not torchrun's summary
            tail = text[first:first + 1500] if first >= 0 else text[-700:]
            emit(part=part, measure="timeout" if timed_out else "error", launch=label, returncode=proc.returncode,
                 seconds=seconds, limit_s=round(limit), log=log_path, stderr_tail=tail)
            self.status[part] = "timeout" if timed_out else "failed"
            return None
        emit(part=part, measure="launch", launch=label, nproc=nproc, seconds=seconds)
        return records


def _stop(proc) -> None:
    """SIGTERM to the launch's process group (torchrun forwards it), SIGKILL 10 s later if it is still there.
    Ranks that outlive a killed torchrun stop themselves (phaserl/parallel/watch.py)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait or None)
            return
        except subprocess.TimeoutExpired:
            continue


# ----- comparisons ------------------------------------------------------------------------------
def agree(a: float, b: float) -> bool:
    return abs(a - b) <= METRIC_REL * max(abs(a), abs(b)) + METRIC_ABS


def update_stats(before_1: dict, after_1: dict, before_n: dict, after_n: dict) -> dict:
    """Cosine of the two runs' weight updates over every trainable tensor, the largest weight gap, the step."""
    names = [k for k in after_1 if after_1[k].is_floating_point() and not torch.equal(after_1[k], before_1[k])]
    if not names:
        return {"update_cos": None, "max_abs_weight_diff": None, "max_abs_step": 0.0, "tensors_updated": 0}
    u1 = torch.cat([(after_1[k].double() - before_1[k].double()).flatten() for k in names])
    un = torch.cat([(after_n[k].double() - before_n[k].double()).flatten() for k in names])
    gap = max((after_1[k].double() - after_n[k].double()).abs().max().item() for k in names)
    cos = torch.nn.functional.cosine_similarity(u1, un, dim=0).item()
    return {"update_cos": round(cos, 6), "max_abs_weight_diff": gap, "max_abs_step": u1.abs().max().item(),
            "tensors_updated": len(names)}


def compare_steps(root: str, world: int) -> list:
    one = torch.load(os.path.join(root, "steps-w1.pt"), weights_only=False)
    many = torch.load(os.path.join(root, f"steps-w{world}.pt"), weights_only=False)
    lines = []
    for scenario, keys in KEYS.items():
        r1, rn = one.get(scenario, {"error": "not run"}), many.get(scenario, {"error": "not run"})
        if "error" in r1 or "error" in rn:
            lines.append(dict(scenario=scenario, passed=False, error=(r1.get("error") or rn.get("error"))[-600:]))
            continue
        metrics = {k: [r1["metrics"].get(k), rn["metrics"].get(k)] for k in keys}
        missing = [k for k, (x, y) in metrics.items() if x is None or y is None]
        bad = [k for k, (x, y) in metrics.items() if k not in missing and not agree(x, y)]
        roles = {}
        for role in r1["after"]:
            roles[role] = update_stats(r1["before"][role], r1["after"][role], rn["before"][role], rn["after"][role])
        cos_ok = all(s["update_cos"] is not None and s["update_cos"] >= UPDATE_COS for s in roles.values())
        same = r1["responses"] == rn["responses"]
        lines.append(dict(scenario=scenario, world=world, same_responses=same, metrics=metrics,
                          metrics_outside_tolerance=bad, metrics_missing=missing, roles=roles,
                          passed=same and not bad and not missing and cos_ok))
    return lines


def compare_chain(root: str, world: int) -> dict:
    load = lambda leg: torch.load(os.path.join(root, f"ckpt-{leg}.pt"), weights_only=False)  # noqa: E731
    straight, c1, c2, c3 = load("straight"), load("c1"), load("c2"), load("c3")
    exact = lambda x, y: x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)  # noqa: E731
    stats = update_stats(straight["resumed"], straight["final"], c1["resumed"], c3["final"])
    steps = [straight["final_step"], c1["final_step"], c2["resumed_step"], c2["final_step"], c3["resumed_step"],
             c3["final_step"]]
    resumes = {f"resume_{world}_to_1_exact": exact(c1["final"], c2["resumed"]),
               f"resume_1_to_{world}_exact": exact(c2["final"], c3["resumed"])}
    return dict(world=world, steps=steps, **resumes, vs_uninterrupted=stats,
                passed=all(resumes.values()) and steps == [3, 1, 1, 2, 2, 3]
                and stats["update_cos"] is not None and stats["update_cos"] >= UPDATE_COS)


def scaling_line(records: list, world: int, label: str) -> dict | None:
    summaries = {r["rank"]: r for r in records if r.get("measure") == "summary"}
    if 0 not in summaries:
        return None
    s = summaries[0]
    build = next((r for r in records if r.get("measure") == "build" and r.get("rank") == 0), {})
    tokens = s["tokens_per_s"]
    return dict(world=world, label=label, s_per_step=s["s_per_step_median"], s_per_step_all=s["s_per_step_all"],
                tokens_per_s=tokens, tokens_per_s_per_gpu=tokens / world if tokens else None,
                peak_allocated_gib_per_gpu=[summaries[r]["timed_peak"]["peak_allocated_gib"]
                                            for r in sorted(summaries)],
                peak_reserved_gib_per_gpu=[summaries[r]["timed_peak"]["peak_reserved_gib"] for r in sorted(summaries)],
                timing_s=s["timing_s_median"], warmup_seconds=s["warmup_seconds"], speed=build.get("speed"),
                overrides=build.get("overrides"))


# ----- the parts --------------------------------------------------------------------------------
def part_world(d: Driver) -> None:
    got = d.launch("world", "world", 1, ["world"], ["--prompts", str(d.a.prompts), "--max-world", str(max(d.worlds)),
                                                    "--steps", str(d.a.steps), "--warmup", str(d.a.warmup)],
                   d.a.timeouts["world"])  # prompts enough for every scaling step at the largest world size
    d.status["world"] = "ok" if got is not None else d.status.get("world", "failed")


def part_correctness(d: Driver) -> None:
    """3 launches: N ranks (steps, the uninterrupted chain, leg 1), 1 rank (steps, leg 2), N ranks (leg 3). Each
    comparison runs when its files exist, so a failed checkpoint leg does not hide the steps' results."""
    n, t = d.worlds[1], d.a.timeouts["launch"]
    steps, legs = [f"steps-w{n}.pt", "steps-w1.pt"], [f"ckpt-{leg}.pt" for leg in ("straight", "c1", "c2", "c3")]
    for name in steps + legs:  # a kept --work holds the last run's: never compare those
        if os.path.exists(os.path.join(d.root, name)):
            os.remove(os.path.join(d.root, name))
    for chain in ("chain-s", "chain-c"):
        shutil.rmtree(os.path.join(d.root, chain), ignore_errors=True)
    d.launch("correctness", f"ranks{n}", n, ["steps", "ckpt:straight:s:3", "ckpt:c1:c:1"], [], t)
    d.launch("correctness", "ranks1", 1, ["steps", "ckpt:c2:c:2"], [], t)
    lines = _compare(d, "correctness", compare_steps, steps, n) or []
    for line in lines:
        emit(part="correctness", measure="compare", **line)
    if lines and d.status.get("correctness") is None:
        d.status["correctness"] = "ok" if all(line["passed"] for line in lines) else "failed"
    d.launch("checkpoint", f"ranks{n}-resume", n, ["ckpt:c3:c:3"], [], t)
    line = _compare(d, "checkpoint", compare_chain, legs, n)
    if line is not None:
        emit(part="checkpoint", measure="compare", **line)
        if d.status.get("checkpoint") is None:
            d.status["checkpoint"] = "ok" if line["passed"] else "failed"
    d.status.setdefault("correctness", "failed")
    d.status.setdefault("checkpoint", "failed")


def _compare(d: Driver, part: str, fn, files: list, world: int):
    """fn(root, world) when every file is there; a missing file or a comparison that raises is reported."""
    missing = [f for f in files if not os.path.isfile(os.path.join(d.root, f))]
    if missing:
        emit(part=part, measure="error", reason=f"no {', '.join(missing)}: a launch above failed")
        return None
    try:
        return fn(d.root, world)
    except Exception as exc:  # noqa: BLE001 - reported; the other parts still run
        emit(part=part, measure="error", reason=f"comparison failed: {type(exc).__name__}: {exc}"[:600])
        return None


def part_scaling(d: Driver) -> None:
    results = {}
    for world in d.worlds:
        got = d.launch("scaling", f"ranks{world}-auto", world, ["scale"], d.scale_args(world, "auto"),
                       d.a.timeouts["scale"])
        line = scaling_line(got, world, "auto") if got is not None else None
        if line is not None:
            results[world] = d.scaling[world, "auto"] = line
            emit(part="scaling", measure="world", **line)
    if 1 in results:
        base = results[1]["tokens_per_s_per_gpu"]
        eff = {f"1_to_{w}": round(r["tokens_per_s_per_gpu"] / base, 3) for w, r in results.items() if w > 1}
        emit(part="scaling", measure="efficiency", per_gpu_efficiency=eff, target=EFFICIENCY_TARGET,
             meets_target={k: v >= EFFICIENCY_TARGET for k, v in eff.items()})
    d.status.setdefault("scaling", "ok" if len(results) == len(d.worlds) else "failed")


SCALING_VARIANTS = {"compile": ["actor.compile=true"],
                    "no_shard_keep_awake": ["actor.fsdp.sharding_strategy=NO_SHARD", "rollout.engine_keep_awake=true"],
                    "no_shard_keep_awake_compile": ["actor.fsdp.sharding_strategy=NO_SHARD",
                                                    "rollout.engine_keep_awake=true", "actor.compile=true"]}


SMOKE_VARIANTS = {"no_shard": ["actor.fsdp.sharding_strategy=NO_SHARD"]}  # --smoke: the code path, on the CPU


def part_scaling_variants(d: Driver) -> None:
    n = d.worlds[1]
    for label, settings in (SMOKE_VARIANTS if d.a.smoke else SCALING_VARIANTS).items():
        got = d.launch("scaling_variants", f"ranks{n}-{label}", n, ["scale"], d.scale_args(n, label, settings),
                       d.a.timeouts["scale"])
        line = scaling_line(got, n, label) if got is not None else None
        if line is not None:
            d.scaling[n, label] = line
            emit(part="scaling_variants", measure="world", **line)
    best = max((line for (w, _), line in d.scaling.items() if w == n), default=None,
               key=lambda line: line["tokens_per_s_per_gpu"] or 0.0)
    if (1, "auto") in d.scaling and best is not None:  # 1 GPU: its auto settings (compile, keep_awake) are the best
        eff = best["tokens_per_s_per_gpu"] / d.scaling[1, "auto"]["tokens_per_s_per_gpu"]
        emit(part="scaling_variants", measure="efficiency_best", world=n, best_label=best["label"],
             per_gpu_efficiency=round(eff, 3), target=EFFICIENCY_TARGET, meets_target=eff >= EFFICIENCY_TARGET)
    d.status.setdefault("scaling_variants", "ok")


def part_switch(d: Driver) -> None:
    n = d.worlds[1]
    got = d.launch("switch", f"ranks{n}", n, ["switch"], ["--prompts", str(d.a.switch_prompts), "--trace-dir",
                   os.path.join(d.a.out, "traces"), "--steps", "2", "--warmup", "1"], d.a.timeouts["switch"])
    if got is None:
        return
    for variant in dict.fromkeys(r["variant"] for r in got if r.get("part") == "switch"):
        mine = [r for r in got if r.get("variant") == variant and r.get("rank") == 0]
        steps = [r for r in mine if r["measure"] == "step"]
        prof = next((r for r in mine if r["measure"] == "profile"), None)
        error = next((r for r in mine if r["measure"] == "error"), None)
        emit(part="switch", measure="variant", variant=variant, world=n, error=error and error["error"],
             to_rollout_s=[r["to_rollout_s"] for r in steps], to_training_s=[r["to_training_s"] for r in steps],
             engine_begin_s=[r["begin_s"] for r in steps], engine_graphs=[r["graphs"] for r in steps],
             kv_cache_gb=[r["kv_cache_gb"] for r in steps], step_s=[r["seconds"] for r in steps],
             mismatch_k3=[r["mismatch"].get("k3") for r in steps])
        if prof is not None:
            emit(part="switch", measure="profile", variant=variant, world=n,
                 **{k: prof[k] for k in ("to_rollout_s", "to_training_s", "wall_s", "categories", "top_host")})
    d.status.setdefault("switch", "ok")


PARTS = {"world": part_world, "correctness": part_correctness, "scaling": part_scaling, "switch": part_switch,
         "scaling_variants": part_scaling_variants}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, 2 gloo ranks, tiny shapes (well under 2 minutes)")
    p.add_argument("--gpus", type=int, default=None, help="world sizes up to this (default: the GPUs visible)")
    p.add_argument("--parts", default=",".join(PART_NAMES),
                   help="comma-separated, run in priority order (world: needed by every other part, once per --work)")
    p.add_argument("--budget", type=float, default=None, help="seconds for everything (default 560; --smoke 330)")
    p.add_argument("--out", default=None, help="raw lines, logs, traces (default $OUT, else a temporary directory)")
    p.add_argument("--work", default=None, help="models, prompts, checkpoints (default: a temporary directory, "
                   "removed at the end; a directory given here is kept and its worlds are reused)")
    p.add_argument("--steps", type=int, default=2, help="scaling: timed steps per launch")
    p.add_argument("--warmup", type=int, default=1, help="scaling: warm-up steps per launch")
    a = p.parse_args(argv)
    unknown = sorted(set(a.parts.split(",")) - set(PART_NAMES))
    if unknown:
        raise SystemExit(f"--parts: {unknown} are not parts; choose from {', '.join(PART_NAMES)}")
    a.device = "cpu" if a.smoke else "cuda"
    a.gpus = 2 if a.smoke else (a.gpus or torch.cuda.device_count())
    if a.gpus < 2:
        raise SystemExit(f"{a.gpus} GPU(s) visible: this benchmark needs 2 or more (or --smoke on the CPU)")
    a.budget = a.budget or (330.0 if a.smoke else 560.0)
    a.out = a.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="multi_gpu_")
    a.keep_work = a.work is not None
    a.work = a.work or tempfile.mkdtemp(prefix="multi_gpu_work_")
    a.prompts = 2 if a.smoke else 32          # scaling: prompts per GPU (x 8 samples at 1.5B; x 4 at --smoke)
    a.switch_prompts = 2 if a.smoke else 16   # switch: prompts per GPU (x 8 samples, 64 new tokens at 0.5B)
    # --smoke: ~75 s on 2 idle cores; the limits leave room for a machine loaded 2-3x (they only catch hangs)
    a.timeouts = ({"world": 120, "launch": 120, "scale": 120, "switch": 120} if a.smoke else
                  {"world": 90, "launch": 120, "scale": 170, "switch": 120})
    return a


def _device_names():
    """From nvidia-smi: the driver process itself never touches CUDA (its context would take GPU 0's memory)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in out.splitlines() if line.strip()]


def main(argv=None) -> int:
    a = parse_args(argv)
    d = Driver(a)
    RESULTS[:] = [open(os.path.join(a.out, "results.jsonl"), "a")]
    emit(part="env", measure="env", gpus=a.gpus, device=a.device, torch=torch.__version__, budget_s=a.budget,
         out=a.out, parts=a.parts, device_names=_device_names() if a.device == "cuda" else "cpu")
    wanted = a.parts.split(",")
    try:
        for name in PART_NAMES:
            if name in wanted:
                PARTS[name](d)
    finally:
        if not a.keep_work:
            shutil.rmtree(a.work, ignore_errors=True)
    emit(part="done", measure="done", seconds=round(time.monotonic() - d.t0, 1), status=d.status)
    return 0 if all(v in ("ok", "skipped") for v in d.status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
