"""the adaptive KL controller with the KL in the loss, and the controller's own bounds.

Before the fix the loss kept the fixed `algorithm.kl_coef` while `train/kl_coef` logged the controller's value,
and the controller's multiplier 1 + e * responses / horizon went negative once a step had more than 5 horizons of
responses (the quickstart with kl_horizon=10: -0.0041 to -1324.8 in 8 steps).
"""
import json
import math
import os

import pytest

from _tiny_run import make_run_dir
from phaserl.algo import AdaptiveKLController
from phaserl.config import load_config
from phaserl.errors import ConfigError
from phaserl.trainer import RLTrainer


@pytest.mark.parametrize("kl", [1.0, 0.0])  # far above the target, and below it
@pytest.mark.parametrize("horizon", [1, 10, 10_000])
def test_the_coefficient_stays_positive_and_bounded_whatever_the_horizon(kl, horizon):
    ctl = AdaptiveKLController(init_coef=0.001, target=0.001, horizon=horizon)
    previous = ctl.value
    for _ in range(200):
        ctl.update(current_kl=kl, n_responses=256)  # the quickstart's 32 × 8 responses a step
        assert 0.8 * previous - 1e-15 <= ctl.value <= 1.2 * previous + 1e-15  # one step moves it at most ×1.2 / ×0.8
        assert 0.001 / 100 - 1e-15 <= ctl.value <= 0.001 * 100 + 1e-12
        previous = ctl.value
    assert ctl.value > 0


def test_the_issue_case_no_longer_goes_negative():
    ctl = AdaptiveKLController(init_coef=0.001, target=0.001, horizon=10)
    for kl in (0.0, 0.023, 0.106, 0.175, 0.344, 0.220, 0.403, 0.247):  # the issue's run, KL per step
        ctl.update(current_kl=kl, n_responses=256)
        assert ctl.value > 0
    assert math.isclose(ctl.value, 0.001 * 0.8 * 1.2 ** 7)  # first step below target, then above: ×0.8, ×1.2 ...


def test_a_horizon_of_many_steps_keeps_ziegler_s_rule():
    ctl = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10_000)
    ctl.update(current_kl=9.0, n_responses=1000)
    assert math.isclose(ctl.value, 0.1 * (1 + 0.2 * 0.1))


def test_an_adaptive_controller_needs_a_positive_start():
    with pytest.raises(ConfigError, match="kl_coef must be > 0"):
        AdaptiveKLController(init_coef=0.0, target=0.01, horizon=100)


@pytest.mark.slow
def test_with_the_kl_in_the_loss_the_loss_uses_the_logged_coefficient(tmp_path, monkeypatch):
    from phaserl.roles.actor import HybridActor

    used = []
    update = HybridActor.update_mini_batch

    def spy(self, mb, **kwargs):
        used.append(self.loss.kl_loss_coef)
        return update(self, mb, **kwargs)

    monkeypatch.setattr(HybridActor, "update_mini_batch", spy)
    cfg = load_config(None, make_run_dir(str(tmp_path)) + [
        "trainer.loggers=[jsonl]", "trainer.total_steps=4", "data.val_files=[]", "algorithm.kl_placement=loss",
        "algorithm.kl_coef=0.05", "algorithm.kl_target=1e-6", "algorithm.kl_horizon=4"])
    RLTrainer.from_config(cfg).fit()
    lines = [json.loads(raw) for raw in open(os.path.join(tmp_path, "logs", "metrics.jsonl"))]
    logged = [line["train/kl_coef"] for line in lines if "train/kl_coef" in line]
    assert used == pytest.approx(logged)  # one optimizer step per RL step: the coefficient in force, as logged
    assert logged[0] == pytest.approx(0.05) and len(set(logged)) > 1  # the controller moved it
