"""CISPO, SAPO, GMPO, DRO, DPPO (TV / KL) and GPG against hand-worked numbers and their gradients."""
import math

import pytest
import torch

from phaserl.algo import POLICY_LOSSES, bind_policy_loss
from phaserl.errors import ConfigError

LOG_HALF, LOG_QUARTER = math.log(0.5), math.log(0.25)


def one_token(logp: float, old: float, adv: float):
    """A [1, 1] batch: logprobs (requires grad), old log-probs, advantage, mask."""
    return (torch.tensor([[logp]], dtype=torch.float64, requires_grad=True), torch.tensor([[old]], dtype=torch.float64),
            torch.tensor([[adv]], dtype=torch.float64), torch.ones(1, 1))


def loss_and_grad(fn, logp, old, adv, mask, **hyper):
    loss, stats = fn(logp, old, adv, mask, **hyper)
    loss.sum().backward()
    return loss.item(), logp.grad.item(), stats


def test_cispo_caps_the_weight_but_keeps_the_gradient():
    # p = 0.5, p_old = 0.25: r = 2, capped at 1 + 0.28 = 1.28; loss = -1.28 * A * log 0.5
    loss, grad, stats = loss_and_grad(POLICY_LOSSES["cispo"], *one_token(LOG_HALF, LOG_QUARTER, 1.0),
                                      clip_low=1.0, clip_high=0.28)
    assert loss == pytest.approx(-1.28 * LOG_HALF)
    assert grad == pytest.approx(-1.28)  # PPO would give 0 here: the token is clipped
    assert stats["clipfrac"].item() == 1.0
    # inside the range the weight is r itself: r = 0.5, A = -1 -> grad = -0.5 * -1
    _, grad, stats = loss_and_grad(POLICY_LOSSES["cispo"], *one_token(LOG_QUARTER, LOG_HALF, -1.0),
                                   clip_low=1.0, clip_high=0.28)
    assert grad == pytest.approx(0.5) and stats["clipfrac"].item() == 0.0


@pytest.mark.parametrize("adv, tau", [(1.0, 1.0), (-1.0, 1.05)])
def test_sapo_gate_is_the_policy_gradient_at_ratio_one(adv, tau):
    # r = 1: gate = sigmoid(0) * 4 / tau = 2 / tau; d gate / d logp = 4 sigmoid (1 - sigmoid) r = 1
    loss, grad, _ = loss_and_grad(POLICY_LOSSES["sapo"], *one_token(-1.0, -1.0, adv), tau_pos=1.0, tau_neg=1.05)
    assert loss == pytest.approx(-adv * 2 / tau)
    assert grad == pytest.approx(-adv)


def test_sapo_gate_fades_smoothly_away_from_one():
    # r = 2, A = 1, tau = 1: loss = -4 sigmoid(1); grad = -4 sigmoid(1)(1 - sigmoid(1)) * 2
    s = 1 / (1 + math.exp(-1))
    loss, grad, _ = loss_and_grad(POLICY_LOSSES["sapo"], *one_token(LOG_HALF, LOG_QUARTER, 1.0),
                                  tau_pos=1.0, tau_neg=1.05)
    assert loss == pytest.approx(-4 * s)
    assert grad == pytest.approx(-4 * s * (1 - s) * 2)


def test_gmpo_geometric_mean_with_sign_aware_log_clip():
    logp = torch.tensor([[0.5, -0.1, 7.0]], dtype=torch.float64, requires_grad=True)  # old = 0: log r
    old, mask = torch.zeros(1, 3, dtype=torch.float64), torch.tensor([[1, 1, 0]])
    adv = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, stats = POLICY_LOSSES["gmpo"](logp, old, adv, mask, clip_low=0.4, clip_high=0.4)
    # A > 0: min(0.5, 0.4) = 0.4 and min(-0.1, -0.1) = -0.1 -> R = exp(0.15); loss -R on both real tokens
    R = math.exp(0.15)
    assert torch.allclose(loss, torch.tensor([[-R, -R, 0.0]], dtype=torch.float64))
    (loss.sum() / 2).backward()  # seq-mean-token-mean of one response
    # token 0 was clipped (no gradient); token 1: d(-R)/dlogp_1 = -R * 1/2
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -R / 2, 0.0]], dtype=torch.float64))
    assert stats["clipfrac"].item() == pytest.approx(0.5)
    # A < 0: the upper clip does not bind (max(0.5, 0.4) = 0.5): R = exp(0.2), loss = +R
    loss, _ = POLICY_LOSSES["gmpo"](logp.detach(), old, -adv, mask, clip_low=0.4, clip_high=0.4)
    assert loss[0, 0].item() == pytest.approx(math.exp(0.2))


def test_dro_quadratic_penalty_by_hand():
    # -(A logp - beta/2 (log r)^2), log r = log 2; grad = -(A - beta log r)
    loss, grad, _ = loss_and_grad(POLICY_LOSSES["dro"], *one_token(LOG_HALF, LOG_QUARTER, 1.0), beta=0.1)
    assert loss == pytest.approx(-(LOG_HALF - 0.05 * math.log(2) ** 2))
    assert grad == pytest.approx(-(1 - 0.1 * math.log(2)))


@pytest.mark.parametrize("name, delta", [("dppo_tv", 0.15), ("dppo_kl", 0.05)])
def test_dppo_masks_only_moves_beyond_the_trust_region_in_the_advantage_direction(name, delta):
    # p = 0.5 from p_old = 0.25: TV 0.25 > 0.15; binary KL = 0.25 log(0.5) + 0.75 log(1.5) = 0.1308 > 0.05
    fn = POLICY_LOSSES[name]
    loss, grad, stats = loss_and_grad(fn, *one_token(LOG_HALF, LOG_QUARTER, 1.0), delta_low=delta, delta_high=delta,
                                      ratio_cap=20.0)
    assert loss == 0.0 and grad == 0.0 and stats["clipfrac"].item() == 1.0  # A > 0 and p rose too far
    # A < 0: the same move goes against the advantage's direction -> kept, weight sg[min(r, 20)] = 2
    loss, grad, stats = loss_and_grad(fn, *one_token(LOG_HALF, LOG_QUARTER, -1.0), delta_low=delta, delta_high=delta,
                                      ratio_cap=20.0)
    assert loss == pytest.approx(2 * LOG_HALF) and grad == pytest.approx(2.0) and stats["clipfrac"].item() == 0.0
    # the ratio cap: r = 40 capped at 20
    _, grad, _ = loss_and_grad(fn, *one_token(math.log(0.4), math.log(0.01), -1.0), delta_low=delta, delta_high=delta,
                               ratio_cap=20.0)
    assert grad == pytest.approx(20.0)


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_dppo_thresholds_depend_on_the_sign_of_the_advantage_as_in_verl(name):
    """verl's DPPO masks by clip_ratio_high where A > 0 and clip_ratio_low where A <= 0."""
    fn = POLICY_LOSSES[name]
    up = one_token(LOG_HALF, LOG_QUARTER, 1.0)      # p 0.25 -> 0.5 with A > 0: 0.25 TV, 0.1308 binary KL
    down = one_token(LOG_QUARTER, LOG_HALF, -1.0)    # p 0.5 -> 0.25 with A < 0: -0.25 TV, 0.1438 binary KL
    wide, narrow = 0.3, 0.01
    assert loss_and_grad(fn, *up, delta_low=narrow, delta_high=wide, ratio_cap=20.0)[2]["clipfrac"].item() == 0.0
    assert loss_and_grad(fn, *up, delta_low=wide, delta_high=narrow, ratio_cap=20.0)[2]["clipfrac"].item() == 1.0
    assert loss_and_grad(fn, *down, delta_low=wide, delta_high=narrow, ratio_cap=20.0)[2]["clipfrac"].item() == 0.0
    assert loss_and_grad(fn, *down, delta_low=narrow, delta_high=wide, ratio_cap=20.0)[2]["clipfrac"].item() == 1.0


def test_dppo_kl_binary_kl_by_hand():
    # p 0.3 -> 0.32, A > 0: KL = 0.3 log(0.3/0.32) + 0.7 log(0.7/0.68) = 0.000947 <= 0.05 -> inside
    _, grad, stats = loss_and_grad(POLICY_LOSSES["dppo_kl"], *one_token(math.log(0.32), math.log(0.3), 1.0),
                                   delta_low=0.05, delta_high=0.05, ratio_cap=20.0)
    assert stats["clipfrac"].item() == 0.0 and grad == pytest.approx(-0.32 / 0.3)


def test_gpg_is_the_plain_policy_gradient():
    loss, grad, _ = loss_and_grad(POLICY_LOSSES["gpg"], *one_token(LOG_HALF, LOG_QUARTER, 2.0))
    assert loss == pytest.approx(-2 * LOG_HALF) and grad == pytest.approx(-2.0)


@pytest.mark.parametrize("name, hyper", [("sapo", dict(tau_pos=1.0, tau_neg=1.05)), ("gmpo", dict(clip_low=0.4,
                         clip_high=0.4)), ("dro", dict(beta=0.1)), ("gpg", {})])
def test_losses_without_stop_gradients_pass_gradcheck(name, hyper):
    # (CISPO and DPPO detach their weights on purpose, so a numerical gradient is not theirs: see above.)
    g = torch.Generator().manual_seed(0)
    old = torch.randn(3, 4, generator=g, dtype=torch.float64) * 0.1 - 1.0
    logp = (old + 0.05 * torch.randn(3, 4, generator=g, dtype=torch.float64)).requires_grad_()  # log r small
    adv = torch.randn(3, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    assert torch.autograd.gradcheck(lambda x: POLICY_LOSSES[name](x, old, adv, mask, **hyper)[0], (logp,))


def test_bind_policy_loss_binds_only_each_losses_own_hyper_parameters_and_knows_verl_names():
    hyper = dict(clip_low=0.2, clip_high=0.28, dual_clip_c=None, tau_pos=1.0, tau_neg=1.05, beta=0.1, delta_low=0.1,
                 delta_high=0.1, ratio_cap=20.0)
    logp, old, adv, mask = one_token(LOG_HALF, LOG_QUARTER, 1.0)
    for name in POLICY_LOSSES:
        loss, stats = bind_policy_loss(name, **hyper)(logp, old, adv, mask)
        assert loss.shape == (1, 1) and {"clipfrac", "approx_kl"} <= set(stats)
    assert bind_policy_loss("geo_mean", **hyper).func is POLICY_LOSSES["gmpo"]
    assert bind_policy_loss("vanilla", **hyper).func is POLICY_LOSSES["ppo"]
    with pytest.raises(ConfigError, match="cispo"):
        bind_policy_loss("clip_cov", **hyper)


@pytest.mark.parametrize("name, hyper, key", [
    ("sapo", dict(tau_pos=0.0, tau_neg=1.0), "sapo_tau"), ("dro", dict(beta=0.0), "dro_beta"),
    ("dppo_tv", dict(delta_low=0.0, delta_high=0.2, ratio_cap=20.0), "dppo_delta"),
    ("dppo_kl", dict(delta_low=0.1, delta_high=0.1, ratio_cap=1.0), "dppo_ratio_cap"),
    ("cispo", dict(clip_low=1.5, clip_high=0.2), "clip_ratio_low")])
def test_bad_hyper_parameters_are_config_errors_naming_the_key(name, hyper, key):
    x = torch.zeros(1, 1)
    with pytest.raises(ConfigError, match=key):
        POLICY_LOSSES[name](x, x, x, torch.ones(1, 1), **hyper)


@pytest.mark.parametrize("overrides, expected", [
    ([], (0.15, 0.15)),                                                       # the paper's TV threshold
    (["actor.dppo_delta=0.1"], (0.1, 0.1)),                                   # one value as the shorthand
    (["actor.clip_ratio_low=0.2", "actor.clip_ratio_high=0.28"], (0.2, 0.28)),  # a verl DPPO config, per sign
    (["actor.dppo_delta=0.1", "actor.clip_ratio_high=0.28"], (0.1, 0.28)),    # a per-sign value wins on its side
])
def test_dppo_reads_verls_per_sign_keys_with_dppo_delta_as_the_shorthand(overrides, expected):
    from phaserl.config import load_config
    from phaserl.trainer.build import policy_loss_fn

    cfg = load_config(None, ["actor.policy_loss=dppo_tv", *overrides])
    fn = policy_loss_fn(cfg.actor)
    assert (fn.keywords["delta_low"], fn.keywords["delta_high"]) == expected


def test_the_other_losses_keep_their_default_clip_range():
    from phaserl.config import load_config
    from phaserl.trainer.build import policy_loss_fn

    assert policy_loss_fn(load_config(None, []).actor).keywords == dict(clip_low=0.2, clip_high=0.2, dual_clip_c=3.0)
    kl = policy_loss_fn(load_config(None, ["actor.policy_loss=dppo_kl"]).actor).keywords
    assert (kl["delta_low"], kl["delta_high"]) == (0.05, 0.05)
