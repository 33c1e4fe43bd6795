"""`phaserl quickstart --task agent` learns: multi-turn episodes, held-out success up by at least 0.20."""
import json

import pytest

from phaserl.cli import main
from phaserl.config import load_config

pytestmark = pytest.mark.slow  # an end-to-end run (see README, "Tests")


def test_agent_quickstart_raises_held_out_success_by_20_points(tmp_path):
    out = tmp_path / "agent"
    assert main(["quickstart", "--task", "agent", "--out", str(out)]) == 0
    lines = [json.loads(line) for line in open(out / "metrics.jsonl")]
    vals = [(m["step"], m["val/score_mean"]) for m in lines if "val/score_mean" in m]
    assert vals[0][0] == 0 and vals[-1][0] == 40
    assert vals[-1][1] - vals[0][1] >= 0.20, vals
    first = next(m for m in lines if m["step"] == 1 and "agent/turns_mean" in m)
    assert first["agent/turns_mean"] > 1.5 and first["agent/observation_tokens_mean"] > 0  # really multi-turn
    assert first["agent/ended/max_turns"] > 0 and first["agent/ended/done"] > 0
    assert load_config(str(out / "config.yaml")).agent.env == "phaserl.world.agent_task:RetryArithmetic"
