"""Float16 training (model.dtype = float16): the loss scale's rule, an overflow skips the step and leaves weights,
moments and schedule alone, AdamW steps float32 masters, and a GRPO run in float16 logs its scale. The learning
check in float16 runs on the GPU (tests/test_float16.py::test_gpu_*)."""
import json
import os

import pytest
import torch

from _tiny_run import make_run_dir
from phaserl.config import load_config
from phaserl.roles.loss_scale import GROWTH_INTERVAL, INIT_SCALE, LossScaler
from phaserl.roles.optim import Optimizer, OptimSettings


def test_the_scale_halves_on_overflow_and_doubles_after_a_run_of_clean_steps():
    s = LossScaler(scale=1024.0, growth_interval=3)
    s.clean(), s.clean()
    s.overflowed()
    assert (s.scale, s.clean_steps, s.skipped) == (512.0, 0, 1)
    s.clean(), s.clean()
    assert s.scale == 512.0
    s.clean()
    assert (s.scale, s.clean_steps) == (1024.0, 0)
    assert LossScaler().scale == INIT_SCALE and LossScaler().growth_interval == GROWTH_INTERVAL


def _fp16_optimizer():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3).half())
    return w, Optimizer([w], OptimSettings(lr=1e-2))


def test_float16_weights_step_through_float32_masters_with_the_loss_unscaled():
    w, opt = _fp16_optimizer()
    before = w.detach().clone()
    opt.scaled(1e-3 * (w.float() ** 2).sum()).backward()
    assert w.grad.dtype == torch.float16 and float(w.grad.abs().max()) > 10  # scaled by 2^16
    norm = opt.step()
    assert norm == pytest.approx(float((2e-3 * before.float()).norm()), rel=1e-3)  # the unscaled gradient's norm
    assert opt.half.weights[0].dtype == torch.float32 and w.dtype == torch.float16
    assert torch.equal(w.detach(), opt.half.weights[0].detach().half()) and not torch.equal(w.detach(), before)
    assert opt.scale_stats("actor") == {"actor/loss_scale": INIT_SCALE, "actor/overflow_skipped": 0.0}


def test_an_overflow_skips_the_step_and_halves_the_scale():
    w, opt = _fp16_optimizer()
    before, lr = w.detach().clone(), opt.lr
    opt.scaled((w.float() * 1e30).sum()).backward()  # inf in float16
    assert opt.step() == 0.0
    assert torch.equal(w.detach(), before) and not opt.opt.state  # no moment was made
    assert opt.scale_stats("actor") == {"actor/loss_scale": INIT_SCALE / 2, "actor/overflow_skipped": 1.0}
    assert opt.sched.last_epoch == 0 and opt.lr == lr
    opt.scaled(1e-3 * (w.float() ** 2).sum()).backward()
    assert opt.step() > 0 and not torch.equal(w.detach(), before)


def test_other_dtypes_have_no_loss_scale():
    w = torch.nn.Parameter(torch.randn(3))
    opt = Optimizer([w], OptimSettings(lr=1e-2))
    loss = w.sum()
    assert opt.scaled(loss) is loss and opt.scale_stats("actor") == {} and opt.half is None


@pytest.mark.slow
def test_a_grpo_run_in_float16_logs_the_loss_scale(tmp_path):
    from phaserl.trainer import RLTrainer

    cfg = load_config(None, make_run_dir(str(tmp_path)) + ["trainer.loggers=[jsonl]", "data.val_files=[]",
                                                           "model.dtype=float16"])
    trainer = RLTrainer.from_config(cfg)
    trainer.fit()
    lines = [json.loads(raw) for raw in open(os.path.join(tmp_path, "logs", "metrics.jsonl"))]
    assert [line["step"] for line in lines] == [1, 2]
    assert next(trainer.actor.model.parameters()).dtype == torch.float16
    for line in lines:
        assert line["actor/loss_scale"] == INIT_SCALE and line["actor/overflow_skipped"] == 0.0, line
        assert line["mismatch/abs_diff_max"] < 0.05


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_float16_learns_the_tiny_task_like_bfloat16(tmp_path):
    """The quickstart's learning check in float16 (on the GPU): the held-out score rises as it does in bf16."""
    from phaserl.trainer import RLTrainer

    scores = {}
    for dtype in ("bfloat16", "float16"):
        root = tmp_path / dtype
        cfg = load_config("phaserl/world/quickstart.yaml", [
            "trainer.device=cuda", f"model.dtype={dtype}", "trainer.loggers=[jsonl]", f"trainer.log_dir={root}",
            f"trainer.checkpoint_path={root / 'ckpt'}"])
        RLTrainer.from_config(cfg).fit()
        lines = [json.loads(raw) for raw in open(root / "metrics.jsonl")]
        vals = [line for line in lines if "val/score_mean" in line or "val/reward_mean" in line]
        key = "val/score_mean" if "val/score_mean" in vals[0] else "val/reward_mean"
        scores[dtype] = (vals[0][key], vals[-1][key])
    (_, b1), (f0, f1) = scores["bfloat16"], scores["float16"]
    assert f1 > f0 + 0.2 and f1 > b1 - 0.15, scores


@pytest.mark.slow
def test_a_float16_run_saves_and_resumes(tmp_path):
    """The float32 masters' AdamW moments go into the checkpoint as the optimizer's state (the offloaded AdamW's
    layout); a resumed run continues from it, its masters remade from the loaded float16 weights."""
    from phaserl.trainer import RLTrainer

    base = make_run_dir(str(tmp_path)) + ["trainer.loggers=[jsonl]", "data.val_files=[]", "model.dtype=float16",
                                          "trainer.save_interval=1"]
    first = RLTrainer.from_config(load_config(None, base + ["trainer.total_steps=1"]))
    first.fit()
    saved = first.actor.optimizer.opt.state[first.actor.optimizer.half.weights[0]]
    again = RLTrainer.from_config(load_config(None, base + ["trainer.total_steps=2"]))
    again.fit()
    lines = [json.loads(raw) for raw in open(os.path.join(tmp_path, "logs", "metrics.jsonl"))]
    assert [line["step"] for line in lines][-1] == 2
    opt = again.actor.optimizer
    assert opt.half is not None and saved["exp_avg_sq"].dtype == torch.float32
    for p, w in zip(opt.params, opt.half.weights):
        assert torch.equal(p.detach(), w.detach().half())


def test_the_memory_count_holds_float32_masters_and_moments_for_float16_weights(tmp_path):
    """The update's memory count (trainer/speed.UpdateCount): AdamW's state of float16 weights is 12 B a parameter
    (master + two moments in float32), six times the weight's 2 B; other dtypes keep two moments of their own."""
    from phaserl.config.validate import sequence_tokens
    from phaserl.trainer import RLTrainer
    from phaserl.trainer.settings import Roles
    from phaserl.trainer.speed import UpdateCount

    counts = {}
    for dtype in ("float16", "bfloat16"):
        cfg = load_config(None, make_run_dir(str(tmp_path / dtype)) + [
            "trainer.loggers=[]", f"model.dtype={dtype}", "algorithm.kl_placement=none"])
        t = RLTrainer.from_config(cfg)
        roles = Roles(actor=t.actor, critic=None, ref_policy=None, reward=t.run.reward, tokenizer=t.run.tokenizer)
        counts[dtype] = UpdateCount.of(cfg, roles, free_bytes=10**6, held_bytes=0, compiled=False,
                                       sequence_tokens=sequence_tokens(cfg))
    weights = sum(p.numel() for p in t.actor.model.parameters()) * 2
    assert counts["bfloat16"].actor_bytes == counts["float16"].actor_bytes == weights
    assert counts["bfloat16"].resident == 3 * weights and counts["float16"].resident == 7 * weights
