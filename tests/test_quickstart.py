"""`phaserl quickstart` learns: the held-out score rises by at least 0.20, config.yaml reproduces the run, and
the scores the README quotes are the ones this run gives (seeded, CPU, to the third decimal)."""
import json
import logging
import os
import re

import pytest

from phaserl.cli import main
from phaserl.config import load_config

pytestmark = pytest.mark.slow  # an end-to-end run (see README, "Tests")


def test_quickstart_raises_the_held_out_score_by_20_points(tmp_path, caplog):
    out = tmp_path / "qs"
    with caplog.at_level(logging.INFO, logger="phaserl"):
        assert main(["quickstart", "--out", str(out)]) == 0
    vals = [(record["step"], record["val/score_mean"]) for record in map(json.loads, open(out / "metrics.jsonl"))
            if "val/score_mean" in record]
    assert vals[0][0] == 0 and vals[-1][0] == 40
    assert vals[-1][1] - vals[0][1] >= 0.20, vals
    cfg = load_config(str(out / "config.yaml"))  # `phaserl train DIR/config.yaml` reads the same run
    assert cfg.trainer.log_dir == str(out) and cfg.algorithm.adv_estimator == "grpo"
    assert "held-out score (greedy, 200 prompts): before" in caplog.text
    # Regression: the README quoted 0.255 -> 0.82 after the committed model had changed.
    quoted = readme_quickstart_scores()
    assert quoted == {step: round(score, 3) for step, score in vals}, (
        f"README.md quotes {quoted}; this run gives {vals}: update the README's quickstart paragraph")


def readme_quickstart_scores() -> dict:
    """{step: score} from the README sentence '**A → B** (step 10: x, 20: y, 30: z)'."""
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")) as f:
        text = f.read()
    match = re.search(r"\*\*(\d\.\d+) → (\d\.\d+)\*\* \(step 10: (\d\.\d+),\s+20: (\d\.\d+),\s+30: (\d\.\d+)\)", text)
    assert match, "README.md has no quickstart sentence '**A → B** (step 10: x, 20: y, 30: z)'"
    first, last, s10, s20, s30 = map(float, match.groups())
    return {0: first, 10: s10, 20: s20, 30: s30, 40: last}
