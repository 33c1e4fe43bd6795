"""What the docs promise across world sizes: rollout samples agree across world sizes only where
rollout.batch_size divides the prompts per rank; the doctor and a resume onto another world size say when it
does not, and a resume without a rank's RNG state says (truthfully) that phaserl's sampling does not need it."""
import logging

import pytest

from _tiny_run import make_run_dir
from phaserl.checkpoint.rng import load_rng
from phaserl.config import load_config
from phaserl.config.invariance import same_samples_world_sizes
from phaserl.doctor import OK, WARN, load_doctor_config, run_doctor
from phaserl.trainer import RLTrainer


def test_same_samples_world_sizes():
    assert same_samples_world_sizes(32, 32) == [1]           # the quickstart: 2 ranks sample differently
    assert same_samples_world_sizes(32, 8) == [1, 2, 4]
    assert same_samples_world_sizes(32, 1) == [1, 2, 4, 8, 16, 32]
    assert same_samples_world_sizes(12, 8) == []


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run_dir(str(tmp_path_factory.mktemp("ws")))  # 4 prompts per step, rollout.batch_size 4


def _batch_sizes(run, *extra, world_size):
    results = run_doctor(load_doctor_config(None, run + list(extra)), world_size=world_size)
    return next(r for r in results if r.name == "batch sizes")


def test_the_doctor_says_when_batch_size_does_not_divide_the_prompts_per_rank(run):
    two = _batch_sizes(run, world_size=2)
    assert two.status == WARN and "rollout.batch_size = 4 does not divide the 2 prompts per rank" in two.message
    assert "rollout.batch_size to a divisor of 2 (e.g. 2)" in two.fix
    one = _batch_sizes(run, world_size=1)
    assert one.status == OK and "rollout samples are the same on 1 rank(s)" in one.details[0]
    fine = _batch_sizes(run, "rollout.batch_size=1", world_size=2)
    assert fine.status == OK and "the same on 1, 2, 4 rank(s)" in fine.details[0]


def test_a_resume_onto_another_world_size_warns_when_samples_will_differ(run, caplog):
    trainer = RLTrainer.from_config(load_config(None, run + ["trainer.loggers=[]"]))
    with caplog.at_level(logging.WARNING, logger="phaserl"):
        trainer._warn_if_samples_change(2)
    assert "written by 2 rank(s) and this run has 1; rollout.batch_size = 4 does not divide" in caplog.text
    caplog.clear()
    import dataclasses

    trainer.run = dataclasses.replace(trainer.run, generate_batch_size=1)
    with caplog.at_level(logging.WARNING, logger="phaserl"):
        trainer._warn_if_samples_change(2)
    assert caplog.text == ""


def test_a_missing_rank_rng_state_is_a_note_not_a_warning(tmp_path, caplog):
    # Regression: it warned "its samples differ", but sampling is reseeded per generate call.
    with caplog.at_level(logging.INFO, logger="phaserl"):
        assert load_rng({}, str(tmp_path), rank=1, seed_hint="seeded") is False
    (record,) = [r for r in caplog.records if "no RNG state for rank 1" in r.getMessage()]
    assert record.levelno == logging.INFO and "phaserl's sampling does not read it" in record.getMessage()
