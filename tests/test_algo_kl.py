"""KL estimators (Schulman 2020), KL shaped into the reward, and the coefficient controllers."""
import math

import pytest
import torch

from phaserl.algo import AdaptiveKLController, FixedKLController, apply_kl_to_rewards, kl_penalty
from phaserl.errors import ConfigError

LOGP = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-1.5, -1.0]])  # log r = logp - ref = [0.5, -1.0]


def test_k1_k2_k3_by_hand():
    assert torch.allclose(kl_penalty(LOGP, REF, "k1"), torch.tensor([[0.5, -1.0]]))
    assert torch.allclose(kl_penalty(LOGP, REF, "k2"), torch.tensor([[0.125, 0.5]]))  # 0.5 * logr^2
    # k3 = exp(-logr) - 1 + logr: exp(-0.5) - 0.5 = 0.106531; exp(1) - 2 = 0.718282
    expected = torch.tensor([[math.exp(-0.5) - 0.5, math.e - 2.0]])
    assert torch.allclose(kl_penalty(LOGP, REF, "k3"), expected, atol=1e-6)


def test_k3_is_clamped_and_its_gradient_is_one_minus_r_inv():
    logp = torch.tensor([[-40.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.5]])
    kl = kl_penalty(logp, ref, "k3")
    assert kl[0, 0].item() == 10.0  # exp(39) - ... clamped to verl's bound
    kl[0, 1].backward()
    # d/dlogp [exp(ref - logp) - 1 - (ref - logp)] = 1 - exp(ref - logp) = 1 - exp(-0.5)
    assert math.isclose(logp.grad[0, 1].item(), 1 - math.exp(-0.5), rel_tol=1e-6)


def test_unknown_estimator_is_a_config_error():
    with pytest.raises(ConfigError, match="k1"):
        kl_penalty(LOGP, REF, "k4")


def test_apply_kl_to_rewards_subtracts_coef_times_kl_on_real_tokens():
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    logp = torch.tensor([[-1.0, -2.0, 3.0]])
    ref = torch.tensor([[-1.5, -1.0, -9.0]])
    mask = torch.tensor([[1, 1, 0]])
    new, kl = apply_kl_to_rewards(rewards, logp, ref, mask, coef=0.1, estimator="k1")
    assert torch.allclose(kl, torch.tensor([[0.5, -1.0, 0.0]]))
    assert torch.allclose(new, torch.tensor([[-0.05, 1.1, 0.0]]))  # 0 - 0.1*0.5; 1 - 0.1*(-1); padding 0


def test_fixed_controller_never_moves():
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=100.0, n_responses=512)
    assert ctl.value == 0.05
    assert ctl.state_dict() == {"value": 0.05}


def test_adaptive_controller_follows_ziegler_2019():
    ctl = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_responses=1000)  # e = 9/6 - 1 = 0.5 -> clipped 0.2; x (1 + 0.2 * 0.1)
    assert math.isclose(ctl.value, 0.1 * 1.02)
    ctl.update(current_kl=6.6, n_responses=5000)  # e = 0.1; x (1 + 0.1 * 0.5)
    assert math.isclose(ctl.value, 0.1 * 1.02 * 1.05)
    ctl.update(current_kl=0.0, n_responses=10000)  # e = -1 -> clipped -0.2; x 0.8
    assert math.isclose(ctl.value, 0.1 * 1.02 * 1.05 * 0.8)

    restored = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value


def test_adaptive_controller_rejects_a_zero_target():
    with pytest.raises(ConfigError, match="kl_target"):
        AdaptiveKLController(init_coef=0.1, target=0.0, horizon=100)


def test_abs_and_verl_names():
    assert torch.allclose(kl_penalty(LOGP, REF, "abs"), torch.tensor([[0.5, 1.0]]))
    for verl_name, ours in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3"), ("low_var_kl+", "k3+")):
        assert torch.equal(kl_penalty(LOGP, REF, verl_name), kl_penalty(LOGP, REF, ours))


def test_the_config_accepts_exactly_the_estimators_kl_penalty_knows():
    from phaserl.algo import KL_ESTIMATOR_NAMES
    from phaserl.config.schema import AlgorithmConfig

    assert AlgorithmConfig.__dataclass_fields__["kl_estimator"].metadata["choices"] == list(KL_ESTIMATOR_NAMES)


@pytest.mark.parametrize("name, value", [("k1+", [0.5, -1.0]), ("k3+", [math.exp(-0.5) - 0.5, math.e - 2.0]),
                                         ("abs+", [0.5, 1.0])])
def test_straight_through_has_the_base_value_and_the_k2_gradient(name, value):
    logp = LOGP.clone().requires_grad_()
    kl = kl_penalty(logp, REF, name)
    assert torch.allclose(kl, torch.tensor([value]), atol=1e-6)
    kl.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[0.5, -1.0]]))  # d/dlogp 0.5 (log r)^2 = log r
