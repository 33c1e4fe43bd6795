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
