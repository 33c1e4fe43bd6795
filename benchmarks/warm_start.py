"""Warm start: the first GRPO step of a fresh process with an empty compile cache (cold) vs the same in a second
process that finds the first one's cache (warm). Target: warm first step <= 40% of the cold one.

Each run is one `benchmarks/grpo_step.py --only ours` process (what `phaserl train` builds, phaserl's defaults
plus --ours-set), on one synthetic world at the 0.5B reference shape (64 prompts x 8, 128 + 256 tokens), with
PHASERL_CACHE_DIR pointing both at one fresh directory: torch's compile caches then live in
$PHASERL_CACHE_DIR/torch-compile (phaserl/compile_cache.py), and TRITON_CACHE_DIR in $PHASERL_CACHE_DIR/triton
so that the hand-written Triton kernels start cold too (phaserl itself leaves Triton's cache where Triton keeps
it, ~/.triton/cache, which persists anyway). TORCHINDUCTOR_CACHE_DIR is removed from the children's
environment. One JSON line per run (`measure=run`: first-step seconds, the compile report of
phaserl's CompileWatch: torch.compile seconds, inductor graph cache hits / misses, whether phaserl saw the
cache as cold) and a `measure=warm_start` line with the ratio.

    python benchmarks/warm_start.py                       # H200: the 0.5B reference shape (~100 s in all)
    python benchmarks/warm_start.py --smoke               # CPU: tiny shape, actor.compile=true (inductor's C++)

The world (random weights, prompts) is made by the first run and reused by the second (`measure=world` line,
not part of any step). Needs what grpo_step.py --only ours needs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = "warm_start"
TARGET = 0.40  # warm first step / cold first step, at most


def emit(**record) -> None:
    print(json.dumps({"bench": BENCH, **record}), flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="grpo_step.py --tiny on the CPU with actor.compile=true "
                   "(the tiny model is below auto compile's size): checks the script and the cache wiring")
    p.add_argument("--steps", type=int, default=1, help="timed steps after the first, per run (0: the first alone)")
    p.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE", help="passed to grpo_step.py")
    p.add_argument("--cache-dir", default=None, help="PHASERL_CACHE_DIR of both runs (default: a fresh temp dir; "
                   "an existing one makes the first run warm too)")
    p.add_argument("--world", default=None, help="a world directory made by grpo_step.py (default: made by run 1)")
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds per run process")
    return p.parse_args(argv)


def run_argv(a, world: str) -> list:
    argv = [sys.executable, os.path.join(HERE, "grpo_step.py"), "--only", "ours", "--world", world,
            "--warmup", "1", "--steps", str(a.steps)]
    overrides = list(a.ours_set)
    if a.smoke:
        argv += ["--tiny"]
        overrides = ["actor.compile=true"] + overrides  # the tiny model stays eager under auto
    for item in overrides:
        argv += ["--ours-set", item]
    return argv


def child_env(cache: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["PHASERL_CACHE_DIR"] = cache
    env["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def one_run(a, label: str, world: str, cache: str) -> dict:
    """One grpo_step.py process: its lines echoed, its summary and wall time returned."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(run_argv(a, world), env=child_env(cache), stdout=subprocess.PIPE, text=True,
                              timeout=a.run_timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or b""  # bytes even with text=True
        print(out.decode(errors="replace") if isinstance(out, bytes) else out, end="", flush=True)
        emit(measure="error", run=label, note=f"killed after --run-timeout {a.run_timeout:.0f} s")
        return {}
    wall = time.perf_counter() - t0
    summary, build = None, None
    for line in proc.stdout.splitlines():
        print(line, flush=True)
        rec = json.loads(line) if line.startswith("{") else None
        if rec and rec.get("measure") == "summary":
            summary = rec
        if rec and rec.get("measure") == "build":
            build = rec
    if proc.returncode != 0 or summary is None:
        emit(measure="error", run=label, returncode=proc.returncode)
        return {}
    first = summary["warmup_seconds"][0]
    record = dict(measure="run", run=label, first_step_s=first, steady_step_s=summary["s_per_step_median"],
                  build_s=build["seconds"] if build else None, process_wall_s=round(wall, 1),
                  compile=summary.get("compile"), speed=build.get("speed") if build else None, cache_dir=cache)
    emit(**record)
    return record


def main(argv=None) -> None:
    a = parse_args(argv)
    cache = a.cache_dir or tempfile.mkdtemp(prefix="warm_start_cache_")
    world = a.world or tempfile.mkdtemp(prefix="warm_start_world_")
    emit(measure="env", smoke=a.smoke, cache_dir=cache, world=world, ours_set=a.ours_set, steps=a.steps)
    cold = one_run(a, "cold", world, cache)
    warm = one_run(a, "warm", world, cache) if cold else {}
    if cold and warm:
        ratio = warm["first_step_s"] / cold["first_step_s"]
        emit(measure="warm_start", cold_first_step_s=cold["first_step_s"], warm_first_step_s=warm["first_step_s"],
             ratio=round(ratio, 3), target_ratio=TARGET, met=ratio <= TARGET,
             cold_compile_s=(cold["compile"] or {}).get("compile_s"),
             warm_compile_s=(warm["compile"] or {}).get("compile_s"),
             warm_cache_hits=(warm["compile"] or {}).get("cache_hits"),
             steady_step_s=warm["steady_step_s"])


if __name__ == "__main__":
    main()
