"""benchmarks/families.py's Qwen3.5 cases run on the CPU (--smoke) and print their JSON lines."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


@pytest.mark.slow
def test_the_delta_rule_and_train_layers_cases_smoke_run(capsys):
    import families
    from phaserl.models import hybrid

    families.main(["--smoke", "--case", "delta_rule,train_layers"])
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    layers = {r["variant"]: r for r in out if r["measure"] == "train_layers"}
    assert set(layers) == {"eager", "hybrid_compiled"} and "error" not in layers["hybrid_compiled"]
    assert layers["hybrid_compiled"]["max_abs_diff"] < 1e-5 and layers["eager"]["tokens"] == 2 * 16
    assert hybrid.COMPILE_HYBRID is False  # the case puts the switch back
    rules = {(r["rule"], r.get("backward")) for r in out if r["measure"] == "delta_rule" and "ms" in r}
    assert {("torch", True), ("torch_blocked", True), ("torch_compiled", True)} <= rules
    assert [r["rule"] for r in out if r["measure"] == "delta_rule_profile"] == ["torch"]


def test_a_grpo_case_past_its_timeout_reports_the_steps_it_finished(monkeypatch, capsys):
    import subprocess

    import families

    done = [{"bench": "grpo_step", "measure": "build", "seconds": 9.1},
            {"bench": "grpo_step", "measure": "step", "step": 0, "warmup": True, "seconds": 61.0}]

    def slow(argv, **kw):
        assert kw["timeout"] == 120.0
        output = ("\n".join(map(json.dumps, done)) + "\nnoise\n").encode()  # what the child printed before the limit
        raise subprocess.TimeoutExpired(argv, kw["timeout"], output=output)

    monkeypatch.setattr(subprocess, "run", slow)
    families.grpo("qwen35-2b", "/nonexistent", "transformers", smoke=False, steps=1, timeout=120.0)
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["measure"] for r in out] == ["grpo_partial", "error"]
    assert out[0]["lines"] == done and out[0]["case"] == "grpo_transformers" and out[0]["timeout_s"] == 120.0
    assert out[1]["error"] == "stopped after 120 s (--case-timeout)"
