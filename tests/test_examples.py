"""Every example config runs end to end (a one-step smoke run on the tiny world) through the CLI."""
import glob
import json
import os

import pytest

from phaserl.cli import main

pytestmark = pytest.mark.slow  # an end-to-end run (see README, "Tests")

EXAMPLES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "examples", "*.yaml")))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: os.path.basename(p))
def test_example_runs_in_smoke_mode(example, tmp_path):
    rc = main(["train", example, "trainer.total_steps=1", "rollout.prompts_per_step=4", "rollout.batch_size=4",
               "data.val_max_prompts=4", "trainer.device=cpu", "trainer.loggers=[jsonl]",
               f"trainer.log_dir={tmp_path}", f"trainer.checkpoint_path={tmp_path / 'ckpt'}"])
    assert rc == 0
    lines = [json.loads(raw) for raw in open(tmp_path / "metrics.jsonl")]
    assert lines[-1]["step"] == 1 and "train/reward_mean" in lines[-1] and "val/score_mean" in lines[-1]
    assert (tmp_path / "config.yaml").exists()


def test_examples_exist_for_every_algorithm():
    names = {os.path.basename(p) for p in EXAMPLES}
    assert {"grpo.yaml", "ppo.yaml", "rloo.yaml", "reinforce_plus_plus.yaml", "remax.yaml"} <= names
    # the 2026 menu: one per estimator / loss family, the DAPO and GSPO recipes, a mismatch correction
    assert {f"{name}.yaml" for name in ("grpo_passk", "opo", "gpg", "cispo", "sapo", "gmpo", "dro", "dppo", "gspo",
                                        "dapo", "grpo_icepop")} <= names
