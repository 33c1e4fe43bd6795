"""Rollout/training mismatch metrics and the corrections (TIS, IcePop, masked IS, seq_mask) by hand."""
import math

import pytest
import torch

from phaserl.algo import aggregate, mismatch_metrics, overlong_penalty, ppo_policy_loss, rollout_correction
from phaserl.errors import ConfigError

# log rho = trainer - rollout = [log 3, log 0.5, log 1.5 | 0, padding]
TRAIN = torch.tensor([[math.log(0.6), math.log(0.1), math.log(0.3)], [math.log(0.4), 0.0, 0.0]])
ROLLOUT = torch.tensor([[math.log(0.2), math.log(0.2), math.log(0.2)], [math.log(0.4), 5.0, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_metrics_by_hand():
    m = mismatch_metrics(TRAIN, ROLLOUT, MASK)
    log_rho = [math.log(3), math.log(0.5), math.log(1.5), 0.0]
    k3 = [math.exp(-x) - 1 + x for x in log_rho]  # KL(rollout || train) from rollout samples
    assert m["mismatch/k3"] == pytest.approx(sum(k3) / 4, rel=1e-5)
    assert m["mismatch/abs_diff_mean"] == pytest.approx(sum(abs(x) for x in log_rho) / 4, rel=1e-5)
    assert m["mismatch/abs_diff_max"] == pytest.approx(math.log(3), rel=1e-5)
    # rho = 3 is outside [0.5, 2]; rho = 0.5 is on the edge (inside); the padding's 5.0 is ignored
    assert m["mismatch/ratio_out_frac"] == pytest.approx(1 / 4)


def test_identical_logprobs_show_no_mismatch():
    m = mismatch_metrics(TRAIN, TRAIN, MASK)
    assert all(v == 0.0 for v in m.values())


@pytest.mark.parametrize("mode, expected", [
    ("tis", [[2.0, 0.5, 1.5], [1.0, 0.0, 0.0]]),        # min(rho, 2)
    ("icepop", [[0.0, 0.5, 1.5], [1.0, 0.0, 0.0]]),     # rho inside [1/2, 2], else 0
    ("masked_is", [[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]),  # 1 inside, 0 outside
    # geometric means: row 0 exp(mean(log 3, log 0.5, log 1.5)) = (2.25)^(1/3) = 1.31 inside [0.5, 2]; row 1 = 1
    ("seq_mask", [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]),
])
def test_correction_weights_by_hand(mode, expected):
    weights, stats = rollout_correction(TRAIN, ROLLOUT, MASK, mode=mode, cap=2.0)
    assert torch.allclose(weights, torch.tensor(expected), atol=1e-6)
    assert stats["rejected"].item() == sum(w == 0 for row, m in zip(expected, MASK.tolist())
                                           for w, real in zip(row, m) if real)


def test_seq_mask_drops_the_whole_response():
    weights, _ = rollout_correction(TRAIN, ROLLOUT, MASK, mode="seq_mask", cap=1.2)  # 1.31 > 1.2
    assert weights[0].tolist() == [0.0, 0.0, 0.0] and weights[1, 0].item() == 1.0


def test_a_correction_composes_with_a_loss_as_a_detached_per_token_weight():
    logp = TRAIN.clone().requires_grad_()
    adv = torch.ones(2, 3)
    weights, _ = rollout_correction(logp, ROLLOUT, MASK, mode="tis", cap=2.0)
    assert not weights.requires_grad
    loss_mat, _ = ppo_policy_loss(logp, logp.detach(), adv, MASK, clip_low=0.2, clip_high=0.2, dual_clip_c=None)
    aggregate(loss_mat * weights, MASK, "token-sum", global_tokens=4, global_seqs=2).backward()
    # on-policy ratio 1: d/dlogp (-A r) = -1 per token, times the weight
    assert torch.allclose(logp.grad, -weights)


def test_bad_corrections_are_config_errors():
    with pytest.raises(ConfigError, match="rollout_correction"):
        rollout_correction(TRAIN, ROLLOUT, MASK, mode="tis2", cap=2.0)
    with pytest.raises(ConfigError, match="rollout_correction_cap"):
        rollout_correction(TRAIN, ROLLOUT, MASK, mode="tis", cap=1.0)


def test_overlong_penalty_dapo_eq13():
    # L_max 10, buffer 4: no penalty up to 6, linear to -factor at 10
    lengths = torch.tensor([3, 6, 7, 8, 10])
    out = overlong_penalty(lengths, max_len=10, buffer=4, factor=0.5)
    assert torch.allclose(out, torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]))
    with pytest.raises(ConfigError, match="overlong_buffer"):
        overlong_penalty(lengths, max_len=10, buffer=11, factor=1.0)
