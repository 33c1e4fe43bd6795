"""Out of memory in any phase (trainer/oom.py): one screen naming the phase, the measured peak against the card
and settings that would fit; the last checkpoint intact and resumable; a non-zero exit and no traceback.

The out-of-memory error is simulated (torch.OutOfMemoryError raised where the phase would allocate) in a tiny CPU
run that saved step 1 and fails during step 2."""
import hashlib
import os

import pytest
import torch

from _tiny_run import make_run_dir
from phaserl.config import load_config
from phaserl.trainer import RLTrainer
from phaserl.trainer.oom import OutOfMemoryStop, is_out_of_memory

OVERRIDES = ["trainer.loggers=[]", "trainer.save_interval=1", "trainer.val_before_train=false",
             "trainer.keep_checkpoint_num=3"]


@pytest.fixture(scope="module")
def run_args(tmp_path_factory):
    return make_run_dir(str(tmp_path_factory.mktemp("oom_run")))


def _trainer(run_args, tmp_path) -> RLTrainer:
    where = [f"trainer.log_dir={tmp_path / 'logs'}", f"trainer.checkpoint_path={tmp_path / 'ckpt'}"]
    return RLTrainer.from_config(load_config(None, run_args + OVERRIDES + where))


def _fail_on_call(n: int, real=None):
    calls = [0]

    def fake(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                         "capacity of 79.11 GiB of which 1.05 GiB is free.")
        return real(*args, **kwargs)
    return fake


def _digests(root: str) -> dict:
    """Every file under `root` but the run lock (released when the run stops) -> its SHA-256."""
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if name == ".lock":
                continue
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _inject(trainer: RLTrainer, phase: str, monkeypatch) -> None:
    """Make `phase` of step 2 (or step 2's save) run out of memory."""
    if phase == "rollout":
        trainer.actor.generate = _fail_on_call(2, trainer.actor.generate)
    elif phase == "score":
        reward = trainer.run.reward
        monkeypatch.setattr(reward, "score", _fail_on_call(2, reward.score))
    elif phase == "forward":
        trainer.ref_policy.compute_logprobs = _fail_on_call(2, trainer.ref_policy.compute_logprobs)
    elif phase == "advantage":
        from phaserl.trainer import core
        monkeypatch.setattr(core, "compute_advantages", _fail_on_call(2, core.compute_advantages))
    elif phase == "update":
        trainer.actor.update_mini_batch = _fail_on_call(2, trainer.actor.update_mini_batch)
    elif phase == "checkpoint":  # half-way through writing step 2: some files are in its directory already
        from phaserl.checkpoint import checkpointer

        def half_written(roles, tmp):
            with open(os.path.join(tmp, "partial.bin"), "wb") as f:
                f.write(b"x" * 1024)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB.")
        real_save = checkpointer.save_roles
        calls = [0]

        def save_roles(roles, tmp):
            calls[0] += 1
            return real_save(roles, tmp) if calls[0] == 1 else half_written(roles, tmp)
        monkeypatch.setattr(checkpointer, "save_roles", save_roles)


@pytest.mark.parametrize("phase", ["rollout", "score", "forward", "advantage", "update", "checkpoint"])
def test_out_of_memory_in_each_phase_stops_with_one_screen_and_the_checkpoint_intact(phase, run_args, tmp_path,
                                                                                    monkeypatch):
    trainer = _trainer(run_args, tmp_path)
    _inject(trainer, phase, monkeypatch)
    saved = {}
    trainer.add_hook("on_save_checkpoint", lambda t: saved.update(_digests(str(tmp_path / "ckpt"))))
    with pytest.raises(OutOfMemoryStop) as caught:
        trainer.fit()
    screen = str(caught.value)
    step = 2 if phase == "checkpoint" else 1
    assert screen.startswith(f"phaserl: out of memory in phase '{phase}' (step {step}) on cpu"), screen
    assert "resident at the peak" in screen and "of the host's" in screen
    if phase != "checkpoint":
        assert "(2.00 GiB more was asked)" in screen
    assert "would fit  " in screen and "actor.checkpoint_layers=" in screen and "ppo.micro_batch_tokens=" in screen
    assert f"checkpoint {tmp_path / 'ckpt' / 'step_1'} is intact" in screen
    assert caught.value.__cause__ is None and caught.value.__suppress_context__  # no chained traceback
    assert _digests(str(tmp_path / "ckpt")) == saved  # step 1 as written; nothing of step 2, no temporary left
    assert sorted(os.listdir(tmp_path / "ckpt")) == sorted(n for n in {p.split(os.sep)[0] for p in saved})


def test_after_an_out_of_memory_stop_the_run_resumes_from_the_last_checkpoint(run_args, tmp_path):
    trainer = _trainer(run_args, tmp_path)
    trainer.actor.update_mini_batch = _fail_on_call(2, trainer.actor.update_mini_batch)
    with pytest.raises(OutOfMemoryStop):
        trainer.fit()
    again = _trainer(run_args, tmp_path)
    again.fit()
    assert again.step_num == 2 and again.val_history  # resumed at step 1, trained step 2


def test_the_command_line_prints_the_screen_and_exits_non_zero(run_args, tmp_path, monkeypatch, capsys):
    from phaserl import cli
    from phaserl.roles.actor import HybridActor

    monkeypatch.setattr(HybridActor, "update_mini_batch", _fail_on_call(1))
    where = [f"trainer.log_dir={tmp_path / 'logs'}", f"trainer.checkpoint_path={tmp_path / 'ckpt'}"]
    code = cli.main(["train", "--defaults", "--skip-doctor", *run_args, *OVERRIDES, *where])
    err = capsys.readouterr().err
    assert code == 1
    assert "phaserl train: error: phaserl: out of memory in phase 'update' (step 0)" in err
    assert "Traceback" not in err and "none written yet" in err


def test_what_counts_as_out_of_memory():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate "
                                         "memory: you tried to allocate 9 bytes"))
    assert not is_out_of_memory(RuntimeError("shape mismatch")) and not is_out_of_memory(ValueError("out of memory"))
