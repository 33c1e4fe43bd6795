"""Rule rewards in the main process vs in reward worker processes (reward.workers), on the CPU.

One JSON line per measurement on stdout. Shape: 512 responses (64 groups of 8), each a short solution ending
in a \\boxed{} answer (fractions, polynomials, roots, integers; about half of them right), scored by the
built-in `boxed_math` (math-verify) unless --functions names others.

Cases:
- batch: `RuleRewards.score` over all 512 at once, as the synchronous step scores, with workers=0 (the main
  process) and each --workers count, the cases timed in turns. `first_s` is the first call (workers start and
  import math-verify), `seconds` the median of --repeats later calls, `speedup` the main process's seconds over
  these. `equal` says the scores are those of the main process. `load_avg`: the machine's 1-minute load.
- stream: the groups complete one by one while the main thread is busy `--decode-ms` per group (a stand-in for
  the decode loop, holding the GIL as the engine's host loop does); each group is submitted as it completes and
  all are collected after the last. `wait_s` is the time from the last group to having every score: what
  scoring adds to the step. With workers=0 the scoring runs at collection, so wait_s is the whole scoring.

    python benchmarks/reward_pool.py                          # workers 0 1 2 4, 512 responses, boxed_math
    python benchmarks/reward_pool.py --workers 2 --repeats 3 --decode-ms 20
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from phaserl.rewards import RuleRewards  # noqa: E402

GROUP = 8


def make_responses(count: int, seed: int = 0) -> tuple[list, list, list]:
    """(responses, ground truths, rows): a short worked solution each, its last \\boxed{} right about half the time."""
    rng = random.Random(seed)
    responses, truths, rows = [], [], []
    for i in range(count):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        kind = i % 4
        truth = [f"\\frac{{{a}}}{{{b}}}", f"{a}x^2+{b}", str(a * b), f"\\sqrt{{{a}}}+{b}"][kind]
        right = rng.random() < 0.5
        wrong = [f"\\frac{{{b}}}{{{a}}}", f"{b}x^2+{a}", str(a * b + 1), f"\\sqrt{{{b}}}+{a}"][kind]
        answer = truth if right else wrong
        if right and kind == 1:
            answer = f"{b}+{a}x^2"  # equal by algebra, not by text
        steps = " ".join(f"Step {k}: we simplify the expression and carry the terms."
                         for k in range(rng.randint(3, 12)))
        responses.append(f"{steps} Therefore the answer is \\boxed{{{answer}}}.")
        truths.append(truth)
        rows.append({"__source__": f"bench row {i}", "data_source": "math"})
    return responses, truths, rows


def busy(ms: float) -> None:
    """Hold the main thread (and the GIL) for `ms`, as the decode loop's host side does."""
    end = time.perf_counter() + ms / 1000
    x = 0
    while time.perf_counter() < end:
        x += 1


def batch_cases(specs, counts: list, data, repeats: int) -> list:
    """Every pool size in `counts` (0 = the main process), each warmed once, then timed in turns: on a shared
    machine the load changes over a run, and taking turns spreads it over every case alike."""
    responses, truths, rows = data
    prompts = ["Compute it."] * len(responses)
    rules = {w: RuleRewards(specs, workers=w) for w in counts}
    lines = {w: {"case": "batch", "workers": w, "seconds_all": []} for w in counts}
    try:
        for w in counts:
            t0 = time.perf_counter()
            lines[w]["scores"] = rules[w].score(prompts, responses, truths, rows)
            lines[w]["first_s"] = round(time.perf_counter() - t0, 3)
        for _ in range(repeats):
            for w in counts:
                t0 = time.perf_counter()
                out = rules[w].score(prompts, responses, truths, rows)
                lines[w]["seconds_all"].append(round(time.perf_counter() - t0, 3))
                lines[w]["equal"] = out == lines[0]["scores"] and lines[w]["scores"] == lines[0]["scores"]
    finally:
        for r in rules.values():
            r.close()
    for line in lines.values():
        line["seconds"] = statistics.median(line["seconds_all"])
        line["speedup"] = round(lines[0]["seconds"] / line["seconds"], 2)
        del line["scores"]
    return [lines[w] for w in counts]


def stream_case(specs, workers: int, data, decode_ms: float, expected) -> dict:
    responses, truths, rows = data
    prompts = ["Compute it."] * len(responses)
    rules = RuleRewards(specs, workers=workers)
    try:
        rules.score(prompts[:GROUP], responses[:GROUP], truths[:GROUP], rows[:GROUP])  # workers started, warm
        t0 = time.perf_counter()
        pending = []
        for s in range(0, len(responses), GROUP):
            busy(decode_ms)
            pending.append(rules.submit(prompts[s:s + GROUP], responses[s:s + GROUP], truths[s:s + GROUP],
                                        rows[s:s + GROUP]))
        decoded = time.perf_counter()
        results = [p.result() for p in pending]
        end = time.perf_counter()
    finally:
        rules.close()
    totals = [t for r in results for t in r[0]]
    return {"case": "stream", "workers": workers, "decode_s": round(decoded - t0, 3), "wait_s": round(end - decoded, 3),
            "step_s": round(end - t0, 3), "equal": expected is None or totals == expected[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--responses", type=int, default=512)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="pool sizes to compare with 0")
    parser.add_argument("--functions", nargs="+", default=["boxed_math"], help="reward.functions names")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-ms", type=float, default=10.0, help="stream case: main-thread work per group")
    args = parser.parse_args()
    specs = [(name, 1.0, {}) for name in args.functions]
    data = make_responses(args.responses)
    common = {"bench": "reward_pool", "responses": args.responses, "functions": args.functions,
              "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}
    expected = RuleRewards(specs).score(["Compute it."] * len(data[0]), *data)
    for line in batch_cases(specs, [0, *args.workers], data, args.repeats):
        print(json.dumps({**common, **line, "load_avg": round(os.getloadavg()[0], 2)}), flush=True)
    for workers in [0, *args.workers]:
        print(json.dumps({**common, "decode_ms": args.decode_ms, **stream_case(specs, workers, data, args.decode_ms,
                                                                               expected),
                          "load_avg": round(os.getloadavg()[0], 2)}), flush=True)


if __name__ == "__main__":
    main()
