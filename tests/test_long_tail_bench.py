"""benchmarks/long_tail.py on its CPU shape: every case reports what it is read by (trained and sampled tokens,
the slots, each rollout's decode steps and rows per step, the async phases' steps), and it runs the product's KV
defaults, not the 0.5B GRPO benchmark's small KV fraction (which starved the synchronous case of slots)."""
import contextlib
import io
import json
import os
import sys

import pytest

from phaserl.config.schema import RolloutConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_the_long_tail_benchmark_reports_every_case_with_the_product_kv_defaults():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import long_tail
    finally:
        sys.path.pop(0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        long_tail.main(["--tiny", "--steps", "2", "--warmup", "1", "--ks", "1", "--sync-once"])
    lines = [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]
    setup = next(m for m in lines if m["measure"] == "setup")
    defaults = RolloutConfig()
    assert setup["engine_memory_fraction"] == defaults.engine_memory_fraction
    assert setup["engine_max_slots"] == defaults.engine_max_slots
    cases = {m["case"]: m for m in lines if m["measure"] == "case"}
    assert set(cases) == {"sync", "async_k1"}
    assert all(c["slots"] >= 1 and c["trained_tokens_per_s"] > 0 for c in cases.values())
    steps = [m for m in lines if m["measure"] == "step"]
    assert all(m["decode_steps"] >= 1 and m["rows_per_step"] >= 1 for m in steps if m["case"] == "sync")
    later = [m for m in steps if m["case"] == "async_k1" and m["step"] >= 1]
    assert later and all(m["async/phase_steps"] >= 1 for m in later)  # the pace: no phase decodes nothing
    summary = next(m for m in lines if m["measure"] == "summary")
    assert set(summary["speedup"]) == {"async_k1"}
