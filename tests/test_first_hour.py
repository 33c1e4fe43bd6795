"""The first hour: what `phaserl train` prints last (the held-out score before -> after; the FAIL lines
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


def test_a_lora_target_that_matches_nothing_names_the_full_key(tmp_path):
    """the error said `lora.target_modules`; the key is `actor.lora.target_modules`."""
    from phaserl.config import load_config
    from phaserl.errors import ConfigError
    from phaserl.trainer import RLTrainer

    cfg = load_config(None, make_run_dir(str(tmp_path)) + ["actor.lora.rank=4", "actor.lora.target_modules=[out_proj]"])
    with pytest.raises(ConfigError, match=r"^actor\.lora\.target_modules=\['out_proj'\] matched no linear layer"):
        RLTrainer.from_config(cfg)


def test_the_walkthrough_downloads_with_the_command_huggingface_hub_ships():
    """`huggingface-cli download` fails with huggingface-hub 2.x, which ships only `hf`."""
    import os
    import re
    import subprocess
    import sys

    doc = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                            "your-own-task.md")).read()
    command = re.search(r"`(hf download [^`]+)`", doc).group(1)
    assert "huggingface-cli download" not in doc
    hf = os.path.join(os.path.dirname(sys.executable), "hf")
    if not os.path.exists(hf):
        pytest.skip("no hf command beside this python (huggingface-hub installs it)")
    usage = subprocess.run([hf, "download", "--help"], capture_output=True, text=True, timeout=60).stdout
    assert all(option in usage for option in re.findall(r"--[a-z-]+", command))


def test_ci_runs_the_readme_commands_word_for_word():
    """Regression: CI installed `.[test,agents,lora]` while the README said `.[test]`, so CI never saw the
    README's own commands fail. After its torch line (CI's wheel store stands in for PyTorch's index), every
    command .ci/run runs is one of the README's."""
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    blocks = re.findall(r"```bash\n(.*?)```", open(os.path.join(root, "README.md")).read(), re.S)
    readme = {line.split("  #")[0].strip() for block in blocks for line in block.splitlines()
              if line.strip() and not line.startswith("#")}
    ci = [line.strip() for line in open(os.path.join(root, ".ci", "run")) if line.strip()
          and not line.strip().startswith("#")]
    after_torch = ci[ci.index("python -m pip install torch==2.13.0") + 1:]
    commands = [c for c in after_torch if not c.startswith(("if ", "fi", "then"))]
    assert 'pip install -e ".[test]"' in commands and "python -m pytest -q tests" in commands
    assert all(c in readme for c in commands), [c for c in commands if c not in readme]
    assert any(line.endswith('pip install -e ".[test]"') and "torch==2.13.0" in line for line in readme)
