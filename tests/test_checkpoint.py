"""Checkpoints written by the trainer: what step_N/ holds, rotation during a run, and trainer.resume
(auto / never / a path) restoring weights, optimizer, LR schedule, KL controller, loader and RNG."""
import copy
import json
import logging
import os
import shutil

import pytest
import torch

from _tiny_run import make_run_dir
from phaserl.checkpoint import manifest
from phaserl.config import load_config, to_dict
from phaserl.errors import ConfigError
from phaserl.trainer import RLTrainer

pytestmark = pytest.mark.slow  # an end-to-end run (see README, "Tests")

RUN = ["trainer.total_steps=3", "trainer.save_interval=1", "trainer.keep_checkpoint_num=2",
       "trainer.loggers=[jsonl]", "trainer.val_before_train=false", "actor.entropy_coef=0.01"]


def _trainer(overrides: list) -> RLTrainer:
    torch.set_num_threads(1)
    return RLTrainer.from_config(load_config(None, overrides))


def _weights(trainer) -> dict:
    return {k: v.clone() for k, v in trainer.actor.model.state_dict().items()}


def _metrics(log_dir: str) -> list:
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(("timing_s/", "perf/", "hybrid/to_"))}
                for line in f]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """3 steps, saving every step, keeping 2: the run every test below resumes from or inspects."""
    root = tmp_path_factory.mktemp("ckpt_run")
    overrides = make_run_dir(str(root)) + RUN
    trainer = _trainer(overrides)
    trainer.fit()
    return dict(root=root, overrides=overrides, trainer=trainer, weights=_weights(trainer),
                optim=copy.deepcopy(trainer.actor.optimizer.state_dict()),
                sampling=trainer.run.sampling_generator.get_state().clone(),
                loader=trainer.run.train_prompts.state_dict(), metrics=_metrics(str(root / "logs")))


def test_rotation_keeps_the_newest_two_and_latest_points_at_the_last(first_run):
    ckpt = first_run["root"] / "ckpt"
    assert sorted(os.listdir(ckpt)) == ["latest", "step_2", "step_3"]
    assert (ckpt / "latest").read_text() == "step_3\n"
    assert first_run["trainer"].last_checkpoint == str(ckpt / "step_3")


def test_a_checkpoint_holds_every_piece_of_the_run(first_run):
    step = first_run["root"] / "ckpt" / "step_3"
    meta = json.loads((step / "metadata.json").read_text())
    assert meta["complete"] is True and meta["step"] == 3 and meta["world_size"] == 1
    assert meta["roles"] == ["actor"] and meta["phaserl_version"]
    assert (step / "dcp" / ".metadata").is_file()
    assert (step / "rng" / "rank_0.safetensors").is_file()
    state = json.loads((step / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["trainer"]["step"] == 3
    assert state["kl_controller"] == {"value": 0.001}
    assert state["prompt_loader"] == first_run["loader"]
    assert [s for s, _ in state["trainer"]["val_history"]] == [3]
    # the resolved config reads back as the run's own
    saved = load_config(str(step / "config.yaml"))
    assert to_dict(saved) == to_dict(load_config(None, first_run["overrides"]))
    assert json.loads((step / "architecture" / "actor.json").read_text())["kind"] == "native"
    assert (step / "tokenizer" / "tokenizer.json").is_file()
    assert not (step / "hf").exists()            # trainer.export_hf is off by default


def test_resume_auto_restores_everything_and_stops_when_the_run_is_done(first_run, caplog):
    trainer = _trainer(first_run["overrides"])
    assert not torch.equal(trainer.actor.model.output_weight, first_run["weights"]["model.embed_tokens.weight"])
    with caplog.at_level(logging.INFO, logger="phaserl"):
        trainer.fit()
    assert "resumed from" in caplog.text and "nothing left to train" in caplog.text
    assert trainer.step == 3
    for name, value in _weights(trainer).items():
        assert torch.equal(value, first_run["weights"][name]), name
    got, want = trainer.actor.optimizer.state_dict(), first_run["optim"]
    assert got["scheduler"] == want["scheduler"]
    for pid, st in want["optimizer"]["state"].items():
        for key, value in st.items():
            assert torch.equal(got["optimizer"]["state"][pid][key], value), (pid, key)
    assert torch.equal(trainer.run.sampling_generator.get_state(), first_run["sampling"])
    assert trainer.run.train_prompts.state_dict() == first_run["loader"]
    assert trainer.val_history == first_run["trainer"].val_history
    assert _metrics(str(first_run["root"] / "logs")) == first_run["metrics"]   # nothing dropped, nothing added


def test_an_auto_micro_batch_resumes_with_the_checkpoints_own(first_run, caplog):
    """ppo.micro_batch_tokens=auto is chosen from the machine's memory: a resume keeps the micro-batch the
    checkpoint was trained with (written as the trainer's state), so the update's sums round as before the stop."""
    state = json.loads((first_run["root"] / "ckpt" / "step_3" / "trainer_state.json").read_text())
    assert state["trainer"]["micro_batch_tokens"] == 64  # the run set ppo.micro_batch_tokens=64
    trainer = _trainer(first_run["overrides"] + ["ppo.micro_batch_tokens=auto"])
    assert trainer.run.train_tokens == 16384  # what this machine (a CPU) chooses for a fresh run
    with caplog.at_level(logging.INFO, logger="phaserl"):
        trainer.fit()  # resumes step_3: nothing left to train
    assert trainer.run.train_tokens == 64
    assert ("ppo.micro_batch_tokens=auto keeps the checkpoint's 64 tokens (this machine's count chose 16384)"
            in caplog.text)
    explicit = _trainer(first_run["overrides"] + ["ppo.micro_batch_tokens=96"])
    explicit.fit()
    assert explicit.run.train_tokens == 96  # a value the user sets wins


def test_resume_from_an_explicit_step_recomputes_the_same_step(first_run, tmp_path, caplog):
    step_2 = str(first_run["root"] / "ckpt" / "step_2")
    branch = tmp_path / "branch"
    trainer = _trainer(first_run["overrides"] + [f"trainer.resume={step_2}", f"trainer.checkpoint_path={branch}"])
    with caplog.at_level(logging.INFO, logger="phaserl"):
        trainer.fit()
    assert f"resumed from {step_2} (step 2;" in caplog.text
    assert "dropped 1 line(s) after step 2" in caplog.text
    for name, value in _weights(trainer).items():
        assert torch.equal(value, first_run["weights"][name]), name
    assert _metrics(str(first_run["root"] / "logs")) == first_run["metrics"]
    assert sorted(os.listdir(branch)) == ["latest", "step_3"]


def test_resume_from_an_older_step_refuses_to_leave_later_ones_for_a_restart(first_run):
    step_2 = str(first_run["root"] / "ckpt" / "step_2")
    trainer = _trainer(first_run["overrides"] + [f"trainer.resume={step_2}"])
    with pytest.raises(ConfigError, match=r"is step 2, but trainer.checkpoint_path=.* holds later checkpoints "
                                          r"\(step_3\) that a restart would resume instead"):
        trainer.fit()


def test_resume_never_refuses_to_mix_with_an_earlier_runs_checkpoints(first_run):
    trainer = _trainer(first_run["overrides"] + ["trainer.resume=never"])
    with pytest.raises(ConfigError, match=r"trainer.resume=never but trainer.checkpoint_path=.* \(step_2, step_3\)"):
        trainer.fit()


def test_resume_from_a_path_that_is_not_a_complete_checkpoint(first_run, tmp_path):
    half = tmp_path / "step_9"
    shutil.copytree(first_run["root"] / "ckpt" / "step_3", half)
    os.remove(half / "metadata.json")
    trainer = _trainer(first_run["overrides"] + [f"trainer.resume={half}"])
    with pytest.raises(ConfigError, match="is not a complete checkpoint: no metadata.json"):
        trainer.fit()


def test_resume_with_other_roles_is_refused(first_run, tmp_path):
    other = tmp_path / "step_3"
    shutil.copytree(first_run["root"] / "ckpt" / "step_3", other)
    meta = json.loads((other / "metadata.json").read_text())
    (other / "metadata.json").write_text(json.dumps({**meta, "roles": ["actor", "critic"]}))
    manifest.write_manifest(str(other), {})   # as if a run with a critic had written it
    trainer = _trainer(first_run["overrides"] + [f"trainer.resume={other}"])
    with pytest.raises(ConfigError, match=r"holds roles \['actor', 'critic'\], this run trains \['actor'\]"):
        trainer.fit()
