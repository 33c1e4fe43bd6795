"""every advantage estimator, policy loss and the rest of algo's menu accept float32 and float64
inputs alike, and give the same numbers (to float32 precision).

The bug: OPO on float64 scores raised `index_add_(): self (Double) and source (Float) must have the same scalar
type` (the mask was made float32 while the scores stayed float64).
"""
import pytest
import torch

from phaserl.algo import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATOR_NAMES,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    ROLLOUT_CORRECTIONS,
    AdvantageInputs,
    aggregate,
    apply_kl_to_rewards,
    bind_policy_loss,
    clipped_value_loss,
    kl_penalty,
    masked_whiten,
    mismatch_metrics,
    rollout_correction,
)

DTYPES = [torch.float32, torch.float64]
HYPER = dict(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0, tau_pos=1.0, tau_neg=1.05, beta=0.1, delta_low=0.15,
             delta_high=0.2, ratio_cap=20.0)


def _batch():
    g = torch.Generator().manual_seed(0)
    B, T = 8, 5
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    mask[4, 1:] = 0
    mask[6, 4:] = 0
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), mask.sum(-1).long() - 1] = torch.rand(B, generator=g)  # score on the last real token
    logp = -torch.rand(B, T, generator=g) * 2
    return dict(rewards=rewards, mask=mask, values=torch.randn(B, T, generator=g), baseline=torch.rand(B, generator=g),
                groups=torch.arange(B) // 4, logp=logp, old=logp + 0.1 * torch.randn(B, T, generator=g),
                ref=logp + 0.1 * torch.randn(B, T, generator=g), adv=torch.randn(B, T, generator=g))


def _as(dtype, x):
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_every_advantage_estimator_takes_either_dtype(name, dtype):
    b = _batch()
    out = {}
    for d in (torch.float32, dtype):
        inputs = AdvantageInputs(token_rewards=_as(d, b["rewards"]), response_mask=b["mask"], group_ids=b["groups"],
                                 values=_as(d, b["values"]), baseline_scores=_as(d, b["baseline"]))
        adv, ret = ADVANTAGE_ESTIMATORS[name](inputs)
        assert adv.dtype == d and ret.dtype == d and torch.isfinite(adv).all()
        out[d] = (adv, ret)
    torch.testing.assert_close(out[dtype][0].float(), out[torch.float32][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[dtype][1].float(), out[torch.float32][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.float64, torch.bool, torch.int64])
@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_every_advantage_estimator_takes_a_float64_batch_with_any_mask_dtype(name, mask_dtype):
    b = _batch()
    inputs = AdvantageInputs(token_rewards=b["rewards"].double(), response_mask=b["mask"].to(mask_dtype),
                             group_ids=b["groups"], values=b["values"].double(), baseline_scores=b["baseline"].double())
    adv, _ = ADVANTAGE_ESTIMATORS[name](inputs)
    assert adv.dtype == torch.float64


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_policy_loss_takes_either_dtype(name, dtype):
    b = _batch()
    out = {}
    for d in (torch.float32, dtype):
        logp = b["logp"].to(d).clone().requires_grad_(True)
        fn = bind_policy_loss(name, **HYPER)
        loss, stats = fn(logp, _as(d, b["old"]), _as(d, b["adv"]), _as(d, b["mask"]))
        total = aggregate(loss, b["mask"], "token-mean", global_tokens=float(b["mask"].sum()), global_seqs=8.0)
        total.backward()
        assert loss.dtype == d and logp.grad.dtype == d and torch.isfinite(logp.grad).all()
        assert all(torch.isfinite(torch.as_tensor(v)).all() or v == float("-inf") for v in stats.values())
        out[d] = (loss.detach(), logp.grad)
    torch.testing.assert_close(out[dtype][0].float(), out[torch.float32][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[dtype][1].float(), out[torch.float32][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kl_value_loss_aggregation_whitening_and_corrections_take_either_dtype(dtype):
    b = _batch()
    mask = _as(dtype, b["mask"])
    logp, ref, old = _as(dtype, b["logp"]), _as(dtype, b["ref"]), _as(dtype, b["old"])
    for name in KL_ESTIMATOR_NAMES:
        assert kl_penalty(logp, ref, name).dtype == dtype
    rewards, kl = apply_kl_to_rewards(_as(dtype, b["rewards"]), logp, ref, mask, coef=0.1, estimator="k3")
    assert rewards.dtype == dtype and kl.dtype == dtype
    values = _as(dtype, b["values"]).requires_grad_(True)
    vf, _ = clipped_value_loss(values, _as(dtype, b["values"]) + 0.1, _as(dtype, b["adv"]), mask, clip_range=0.2)
    aggregate(vf, mask, "token-mean", global_tokens=float(mask.sum()), global_seqs=8.0).backward()
    assert values.grad.dtype == dtype
    for mode in LOSS_AGG_MODES:
        assert torch.isfinite(aggregate(_as(dtype, b["adv"]), mask, mode, global_tokens=float(mask.sum()),
                                        global_seqs=8.0, max_len=5))
    assert masked_whiten(_as(dtype, b["adv"]), mask).dtype == dtype
    for mode in ROLLOUT_CORRECTIONS:
        weights, _ = rollout_correction(old, logp, mask, mode=mode, cap=2.0)
        assert torch.isfinite(weights).all()
    assert all(map(lambda v: v == v, mismatch_metrics(old, logp, mask).values()))
