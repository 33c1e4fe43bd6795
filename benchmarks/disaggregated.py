"""A GRPO run with a rollout rank of its own: one trainer and one rollout process under one torchrun launch.

On one GPU both processes share it (torch.distributed then runs over gloo: the weights are staged through host
memory). The shape is benchmarks/grpo_step.py's (Qwen2-0.5B architecture, random weights, bf16; --prompts x --n
samples, --prompt-len + --new-tokens), with `rollout.ranks=1 rollout.max_staleness=K`. One JSON line per
trained step, then a summary: trained tokens/s (the sampled tokens of the step's batch over its wall time), the
weight broadcast per update (`timing_s/weight_sync`), the wait for samples (`timing_s/rollout`), and the staleness
histogram (share of trained tokens 0 .. K versions behind).

    python benchmarks/disaggregated.py                          # GPU: 0.5b, 6 steps, K = 1
    python benchmarks/disaggregated.py --tiny --steps 3         # CPU smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import grpo_step  # noqa: E402  (the world and phaserl's config for the GRPO shapes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU-sized model and batch (smoke test)")
    p.add_argument("--shape", choices=["0.5b", "1.5b"], default="0.5b")
    p.add_argument("--steps", type=int, default=6, help="RL steps (the first one includes warm-up)")
    p.add_argument("--staleness", type=int, default=1, help="rollout.max_staleness")
    p.add_argument("--prompts", type=int, default=None)
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--kv-fraction", type=float, default=0.3, help="rollout.engine_memory_fraction (the GPU is shared)")
    p.add_argument("--timeout", type=float, default=540.0, help="seconds for the launch")
    a = p.parse_args()
    base = ["--tiny"] if a.tiny else ["--shape", a.shape]
    base += [f"--steps={a.steps}", "--warmup=0"]
    base += [f"--prompts={a.prompts}"] if a.prompts else []
    base += [f"--new-tokens={a.new_tokens}"] if a.new_tokens else []
    g = grpo_step.parse_args(base + [f"--kv-fraction={a.kv_fraction}"])
    root = grpo_step.make_world(g)
    log_dir = tempfile.mkdtemp(prefix="disaggregated_")
    cfg = grpo_step.ours_config(g, root, log_dir)
    cfg["rollout"].update(ranks=1, max_staleness=a.staleness)
    cfg["trainer"].update(total_steps=a.steps)
    path = os.path.join(log_dir, "config.json")  # JSON is YAML
    with open(path, "w") as f:
        json.dump(cfg, f)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "phaserl",
               "train", path, "--skip-doctor"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}  # the reward's module
    done = subprocess.run(command, timeout=a.timeout, capture_output=True, text=True, env=env)
    if done.returncode:
        print(json.dumps({"bench": "disaggregated", "measure": "error", "returncode": done.returncode,
                          "stderr_tail": done.stderr[-3000:], "stdout_tail": done.stdout[-2000:]}))
        raise SystemExit(1)
    steps = [json.loads(line) for line in open(os.path.join(log_dir, "metrics.jsonl"))]
    rows = []
    for m in steps:
        tokens = m["train/response_length_mean"] * g.prompts * g.n
        row = {"step": m["step"], "trained_tokens_per_s": round(tokens / m["timing_s/step"], 1),
               "s_per_step": round(m["timing_s/step"], 3),
               "weight_sync_s": round(m.get("timing_s/weight_sync", 0.0), 4),
               "sample_wait_s": round(m.get("timing_s/rollout", 0.0), 3),
               "staleness": {k.rsplit("/", 1)[1]: round(v, 4) for k, v in m.items() if "token_share/behind" in k},
               "dropped_groups": m.get("async/dropped_groups"), "reward_mean": m["train/reward_mean"]}
        rows.append(row)
        print(json.dumps({"bench": "disaggregated", "measure": "step", **row}))
    timed = rows[1:] or rows
    print(json.dumps({"bench": "disaggregated", "measure": "summary", "shape": "tiny" if a.tiny else a.shape,
                      "max_staleness": a.staleness, "steps_timed": len(timed),
                      "trained_tokens_per_s": round(statistics.median(r["trained_tokens_per_s"] for r in timed), 1),
                      "weight_sync_s": round(statistics.median(r["weight_sync_s"] for r in timed), 4),
                      "sample_wait_s": round(statistics.median(r["sample_wait_s"] for r in timed), 3),
                      "staleness": {k: round(statistics.mean(r["staleness"].get(k, 0.0) for r in timed), 4)
                                    for k in timed[-1]["staleness"]}, "log_dir": log_dir}))


if __name__ == "__main__":
    main()
