"""benchmarks/multi_gpu.py --smoke: the several-GPU driver on the CPU (2 gloo ranks, tiny shapes), so that the one
device call needs is known to run end to end. Speed is not asserted; agreement of 1 and 2 ranks is (the
smoke runs float32, inside the driver's bf16 tolerance by far)."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # about 75 s: eight launches of 1 or 2 processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_smoke_run_prints_every_part_and_1_rank_agrees_with_2(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "multi_gpu.py"), "--smoke",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=420, env=env)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    by = lambda part, measure: [r for r in lines if r["part"] == part and r["measure"] == measure]  # noqa: E731
    compares = {r["scenario"]: r for r in by("correctness", "compare")}
    assert set(compares) == {"grpo", "ppo_rm", "grpo_lora", "grpo_mistral", "grpo_gemma3",
                             "grpo_moe_replay"}
    for name, r in compares.items():
        assert r["passed"] and r["same_responses"], name
        assert all(s["tensors_updated"] > 0 and s["max_abs_step"] > 0 for s in r["roles"].values()), name
    assert set(compares["ppo_rm"]["roles"]) == {"actor", "critic"}
    chain = by("checkpoint", "compare")[0]
    assert chain["resume_2_to_1_exact"] and chain["resume_1_to_2_exact"] and chain["passed"]
    assert [r["world"] for r in by("scaling", "world")] == [1, 2]
    assert "1_to_2" in by("scaling", "efficiency")[0]["per_gpu_efficiency"]
    variants = {r["variant"]: r for r in by("switch", "variant")}
    assert set(variants) == {"full_shard", "full_shard_offload", "no_shard_keep_awake"}
    assert all(len(r["to_rollout_s"]) == 3 and r["error"] is None for r in variants.values())
    assert {r["variant"] for r in by("switch", "profile")} == set(variants)
    assert by("switch", "profile")[0]["categories"]["gather"]["events"] > 0  # FULL_SHARD gathers in the switch
    assert [r["label"] for r in by("scaling_variants", "world")] == ["no_shard"]
    assert by("scaling_variants", "efficiency_best")[0]["best_label"] in ("auto", "no_shard")
    assert by("done", "done")[0]["status"]["correctness"] == "ok"
    assert os.path.getsize(tmp_path / "raw.jsonl") > 0
    with open(tmp_path / "results.jsonl") as f:  # the results whole (stdout drops the bulky keys)
        profiles = [r for r in map(json.loads, f) if r["measure"] == "profile"]
    assert profiles and all("top_host" in r for r in profiles) and "top_host" not in by("switch", "profile")[0]
