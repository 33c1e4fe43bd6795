"""Exact resume of a float16 run: the loss scale (its value, the clean steps since its last change and the skipped
steps) is saved with each role's optimizer state, so a run that overflowed, crashed and resumed ends with the same
weights, AdamW moments, loss scale and metrics.jsonl lines (timing_s/* and perf/* aside) as the uninterrupted
run; an older checkpoint without the scale still loads, from the initial scale, with a log line.

The overflow is forced: the actor's first optimizer step of step 1 gets an inf in one gradient (the step is
skipped, the scale halves), and the scale doubles after 3 clean steps instead of 2000, so the run crosses a
change of scale on each side of the checkpoint at step 2. The crash is an exception in the update of step 3 (one
optimizer step of it done in memory), as tests/test_resume_kill.py's kill does it in a child process."""
import json
import logging
import os

import pytest
import torch

from _tiny_run import make_run_dir
from phaserl.config import load_config
from phaserl.roles.loss_scale import INIT_SCALE

pytestmark = pytest.mark.slow  # three tiny runs end to end (~10 s on 2 cores)

NOT_COMPARED = ("timing_s/", "perf/", "hybrid/to_")
GROWTH_EVERY = 3


class Crash(RuntimeError):
    pass


def _trainer(overrides: list, *, crash_at: int = 0):
    """A float16 run whose step 1 overflows once; `crash_at`: raise in the update of that step."""
    from phaserl.trainer import RLTrainer

    trainer = RLTrainer.from_config(load_config(None, overrides))
    half = trainer.actor.optimizer.half
    half.scaler.growth_interval = GROWTH_EVERY
    step, injected = half.step, []

    def overflowing_step(opt, clip):
        if trainer.step_num == 0 and not injected:  # step_num counts finished steps: this is step 1
            injected.append(True)
            grad = next(p.grad for p in half.params if p.grad is not None)
            grad.view(-1)[0] = float("inf")
        return step(opt, clip)
    half.step = overflowing_step
    if crash_at:
        update = trainer.actor.update_mini_batch

        def crashing_update(*args, **kwargs):
            stats = update(*args, **kwargs)
            if trainer.step_num + 1 == crash_at:
                raise Crash(f"crash in the update of step {crash_at}")
            return stats
        trainer.actor.update_mini_batch = crashing_update
    return trainer


def _metrics(run_dir) -> list:
    with open(os.path.join(run_dir, "logs", "metrics.jsonl"), encoding="utf-8") as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(NOT_COMPARED)} for line in f]


def _overrides(tmp_path, name: str) -> list:
    run = tmp_path / name
    return make_run_dir(str(tmp_path / "base")) + [
        "trainer.loggers=[jsonl]", "data.val_files=[]", "model.dtype=float16", "trainer.total_steps=4",
        "trainer.save_interval=2", f"trainer.log_dir={run / 'logs'}", f"trainer.checkpoint_path={run / 'ckpt'}"]


def test_a_float16_run_that_overflowed_resumes_with_its_loss_scale_exactly(tmp_path, caplog):
    reference = _trainer(_overrides(tmp_path, "reference"))
    reference.fit()
    expected = _metrics(tmp_path / "reference")
    # the scale halved at step 1 and doubled back after GROWTH_EVERY clean steps, the last of them after the resume
    assert [r["actor/loss_scale"] for r in expected] == [INIT_SCALE / 2] * 3 + [INIT_SCALE]
    assert [r["actor/overflow_skipped"] for r in expected] == [1.0] * 4

    killed = _overrides(tmp_path, "killed")
    with pytest.raises(Crash):
        _trainer(killed, crash_at=3).fit()
    saved = json.loads((tmp_path / "killed" / "ckpt" / "step_2" / "roles.json").read_text())
    assert saved["actor"]["loss_scale"] == {"scale": INIT_SCALE / 2, "clean_steps": 1, "skipped": 1}
    with caplog.at_level(logging.INFO, logger="phaserl"):
        resumed = _trainer(killed)
        resumed.fit()
    assert "resumed from" in caplog.text and "no float16 loss scale" not in caplog.text

    assert _metrics(tmp_path / "killed") == expected
    a, b = reference.actor.optimizer, resumed.actor.optimizer
    assert a.half.scaler.state_dict() == b.half.scaler.state_dict()
    for name, p in reference.actor.model.state_dict().items():
        assert torch.equal(p, resumed.actor.model.state_dict()[name]), name
    for wa, wb in zip(a.half.weights, b.half.weights):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a.opt.state[wa][key], b.opt.state[wb][key]), key


def test_a_checkpoint_without_the_loss_scale_loads_from_the_initial_scale(tmp_path, caplog, monkeypatch):
    """An older checkpoint (no loss_scale in roles.json) resumes; the scale starts from INIT_SCALE, logged."""
    from phaserl.roles.checkpointed import CheckpointedRole

    overrides = _overrides(tmp_path, "old")
    with monkeypatch.context() as m:  # written as a checkpoint without the loss scale is
        full = CheckpointedRole.checkpoint_state_dicts
        m.setattr(CheckpointedRole, "checkpoint_state_dicts",
                  lambda self: {k: v for k, v in full(self).items() if k != "loss_scale"})
        _trainer(overrides + ["trainer.total_steps=2"]).fit()
    roles = json.loads((tmp_path / "old" / "ckpt" / "step_2" / "roles.json").read_text())
    assert "loss_scale" not in roles["actor"]
    with caplog.at_level(logging.INFO, logger="phaserl"):
        _trainer(overrides + ["trainer.total_steps=3"]).fit()
    assert "actor: the checkpoint has no float16 loss scale" in caplog.text
    assert [r["actor/loss_scale"] for r in _metrics(tmp_path / "old")] == [INIT_SCALE / 2] * 2 + [INIT_SCALE]
