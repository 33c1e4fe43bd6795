"""User hooks on the five events: the verl-style example works, each event fires at its moment with the trainer's
`.rank`, `.step`, `.checkpoint_path`, `.log_dir`, `.metrics`, and a hook that raises stops the run naming
itself and the event while the checkpoints already written stay (and resume)."""
import logging
import os

import pytest
import torch

from _tiny_run import make_run_dir
from phaserl.config import load_config
from phaserl.trainer import RLTrainer
from phaserl.trainer.hooks import EVENTS, HookError

RUN = ["trainer.total_steps=2", "trainer.save_interval=1", "trainer.loggers=[jsonl]"]


def _trainer(root, extra=()) -> RLTrainer:
    torch.set_num_threads(1)
    return RLTrainer.from_config(load_config(None, make_run_dir(str(root)) + RUN + list(extra)))


@pytest.mark.slow
def test_the_verl_style_example_and_the_order_of_the_five_events(tmp_path, capsys):
    trainer = _trainer(tmp_path)
    seen = []
    for event in EVENTS:
        trainer.add_hook(event, lambda t, event=event: seen.append(
            (event, t.step, sorted(k for k in t.metrics if k in ("train/reward_mean", "val/score_mean")))))

    def checkpoint_is_complete(t):
        assert os.path.isfile(os.path.join(t.last_checkpoint, "metadata.json"))
        assert t.last_checkpoint == os.path.join(t.checkpoint_path, f"step_{t.step}")
    trainer.add_hook("on_save_checkpoint", checkpoint_is_complete)
    trainer.add_hook("on_save_checkpoint",
                     lambda trainer: print(f"[Rank {trainer.rank}] Saved checkpoint to {trainer.checkpoint_path}"))
    trainer.fit()
    ckpt = tmp_path / "ckpt"
    assert capsys.readouterr().out.count(f"[Rank 0] Saved checkpoint to {ckpt}\n") == 2
    val, train, both = ["val/score_mean"], ["train/reward_mean"], ["train/reward_mean", "val/score_mean"]
    assert seen == [("on_train_start", 0, []), ("on_validation_end", 0, val),
                    ("on_step_end", 1, train), ("on_save_checkpoint", 1, train),
                    ("on_validation_end", 2, both), ("on_step_end", 2, both), ("on_save_checkpoint", 2, both),
                    ("on_train_end", 2, both)]
    assert trainer.log_dir == str(tmp_path / "logs")


@pytest.mark.slow
def test_a_raising_hook_stops_the_run_and_keeps_the_checkpoints(tmp_path, caplog):
    trainer = _trainer(tmp_path)

    def upload_to_bucket(t):
        if t.step == 2:
            raise ConnectionError("bucket unreachable")
    trainer.add_hook("on_step_end", upload_to_bucket)
    with pytest.raises(HookError, match=r"hook .*upload_to_bucket for event 'on_step_end' raised ConnectionError: "
                                        r"bucket unreachable \(step 2\); checkpoints already written are kept"):
        trainer.fit()
    ckpt = tmp_path / "ckpt"
    assert sorted(os.listdir(ckpt)) == ["latest", "step_1"]
    # the same command without the failing hook resumes from what stayed
    again = _trainer(tmp_path)
    with caplog.at_level(logging.INFO, logger="phaserl"):
        again.fit()
    assert f"resumed from {ckpt / 'step_1'} (step 1;" in caplog.text
    assert again.step == 2 and os.path.isdir(ckpt / "step_2")


@pytest.mark.slow
def test_a_hook_failing_on_save_leaves_that_checkpoint_complete(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.add_hook("on_save_checkpoint", lambda t: 1 / 0)
    with pytest.raises(HookError, match="for event 'on_save_checkpoint' raised ZeroDivisionError"):
        trainer.fit()
    assert (tmp_path / "ckpt" / "step_1" / "metadata.json").is_file()
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_1\n"


def test_unknown_events_and_non_callables_are_refused(tmp_path):
    trainer = _trainer(tmp_path)
    with pytest.raises(ValueError, match="did you mean 'on_save_checkpoint'"):
        trainer.add_hook("on_checkpoint_save", print)
    with pytest.raises(TypeError, match="must be callable"):
        trainer.add_hook("on_step_end", "print")
