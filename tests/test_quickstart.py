"""`phaserl quickstart` learns: the held-out score rises by at least 0.20, and config.yaml reproduces the run."""
import json
import logging

import pytest

from phaserl.cli import main
from phaserl.config import load_config

pytestmark = pytest.mark.slow  # an end-to-end run (see README, "Tests")


def test_quickstart_raises_the_held_out_score_by_20_points(tmp_path, caplog):
    out = tmp_path / "qs"
    with caplog.at_level(logging.INFO, logger="phaserl"):
        assert main(["quickstart", "--out", str(out)]) == 0
    vals = [(l["step"], l["val/score_mean"]) for l in map(json.loads, open(out / "metrics.jsonl"))
            if "val/score_mean" in l]
    assert vals[0][0] == 0 and vals[-1][0] == 40
    assert vals[-1][1] - vals[0][1] >= 0.20, vals
    cfg = load_config(str(out / "config.yaml"))  # `phaserl train DIR/config.yaml` reads the same run
    assert cfg.trainer.log_dir == str(out) and cfg.algorithm.adv_estimator == "grpo"
    assert "held-out score (greedy, 200 prompts): before" in caplog.text
