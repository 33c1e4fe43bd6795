"""Issue 47, the first hour: what `phaserl train` prints last (the held-out score before -> after; the FAIL lines
when the preflight stops it), and what the doctor prints for one CPU process."""
import json
import logging

import pytest

from _tiny_run import make_run_dir
from phaserl.cli import main


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer: {seed: 0}\n")
    return str(path)


def test_a_stopped_preflight_repeats_its_fail_lines_last(tmp_path, config, capsys):
    overrides = make_run_dir(str(tmp_path)) + ["critic.hybrid_engine={enable_rollout_optimization_switch: true}"]
    assert main(["train", config, *overrides]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-3].startswith("phaserl train: stopped before training: 1 preflight check(s) FAILed:")
    assert err[-2].startswith("FAIL parallel settings  critic.hybrid_engine must be null")
    assert err[-1] == "fix it, or pass --skip-doctor to train anyway"


@pytest.mark.slow
def test_train_ends_with_the_held_out_score_before_and_after(tmp_path, config, caplog):
    overrides = make_run_dir(str(tmp_path)) + ["trainer.loggers=[console,jsonl]", "trainer.val_interval=1"]
    with caplog.at_level(logging.INFO, logger="phaserl"):
        assert main(["train", "--skip-doctor", config, *overrides]) == 0
    last = caplog.records[-1].getMessage()
    assert last.startswith("held-out score (greedy, 8 prompts): before ") and " -> after " in last, last
    # 2 steps, 3 validations: 10 switches, of which the console shows the first each way (item 8)
    switches = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[HybridEngine] Switching")]
    assert len(switches) == 2
    lines = [json.loads(line) for line in open(tmp_path / "logs" / "metrics.jsonl")]
    assert sum(line.get("hybrid/switches", 0) for line in lines) == 10


@pytest.mark.slow
def test_train_without_validation_ends_with_done(tmp_path, config, caplog):
    overrides = make_run_dir(str(tmp_path)) + ["trainer.loggers=[console,jsonl]", "data.val_files=[]"]
    with caplog.at_level(logging.INFO, logger="phaserl"):
        assert main(["train", "--skip-doctor", config, *overrides]) == 0
    assert caplog.records[-1].getMessage().startswith("phaserl: done at step 2")
