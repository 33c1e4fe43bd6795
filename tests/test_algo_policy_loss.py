"""PPO (clip-higher, dual-clip) and GSPO losses against hand-worked numbers and gradients."""
import math

import pytest
import torch

from phaserl.algo import POLICY_LOSSES, aggregate
from phaserl.errors import ConfigError

CLIP = dict(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)


def ratios_to_logprobs(ratios):
    # old log-probs 0, so logprobs = log ratio
    return torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float32, requires_grad=True)


def test_ppo_clip_higher_and_dual_clip_by_hand():
    logp = ratios_to_logprobs([1.5, 0.5, 0.5, 5.0, 2.0, 1.0])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    loss, stats = POLICY_LOSSES["ppo"](logp, torch.zeros_like(logp), adv, mask, **CLIP)
    # token 0 A=+1 r=1.5: max(-1.5, -1.28) = -1.28   (clipped at 1 + clip_high = 1.28)
    # token 1 A=+1 r=0.5: max(-0.5, -0.8)  = -0.5    (positive A is not clipped below)
    # token 2 A=-1 r=0.5: max(0.5, 0.8)    = 0.8     (clipped at 1 - clip_low = 0.8)
    # token 3 A=-1 r=5:   max(5, 1.28) = 5 -> dual clip min(5, -A c = 3) = 3
    # token 4 A=-1 r=2:   max(2, 1.28) = 2 < 3, dual clip inactive
    # token 5 padding -> 0
    assert torch.allclose(loss, torch.tensor([[-1.28, -0.5, 0.8, 3.0, 2.0, 0.0]]), atol=1e-6)
    assert torch.isclose(stats["clipfrac"], torch.tensor(2 / 5))  # tokens 0 and 2
    assert torch.isclose(stats["clipfrac_dual"], torch.tensor(1 / 5))  # token 3
    assert torch.isclose(stats["ratio_mean"], torch.tensor((1.5 + 0.5 + 0.5 + 5 + 2) / 5))
    assert torch.isclose(stats["ratio_max"], torch.tensor(5.0))
    # approx_kl: k3 = (r - 1) - log r averaged over the 5 real tokens
    k3 = sum((r - 1) - math.log(r) for r in [1.5, 0.5, 0.5, 5.0, 2.0]) / 5
    assert math.isclose(stats["approx_kl"].item(), k3, rel_tol=1e-5)
    assert all(not v.requires_grad for v in stats.values())

    loss.sum().backward()
    # clipped tokens carry no gradient; unclipped: d(-A r)/dlogp = -A r -> token 1: -0.5, token 4: +2
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -0.5, 0.0, 0.0, 2.0, 0.0]]), atol=1e-6)


def test_ppo_without_dual_clip_keeps_the_large_loss():
    logp = ratios_to_logprobs([5.0])
    loss, _ = POLICY_LOSSES["ppo"](logp, torch.zeros_like(logp), torch.tensor([[-1.0]]), torch.ones(1, 1),
                                   clip_low=0.2, clip_high=0.2, dual_clip_c=None)
    assert torch.allclose(loss, torch.tensor([[5.0]]))


def test_gspo_uses_the_length_normalised_sequence_ratio():
    # row 0: token log ratios 0.2, 0.4 (padding 7 ignored) -> log s = 0.3, s = 1.3499 > 1.28 -> clipped
    # row 1: log ratios -0.1, 0.1, 0.0 -> s = 1, A = -1 -> loss 1 on each real token
    logp = torch.tensor([[0.2, 0.4, 7.0], [-0.1, 0.1, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, stats = POLICY_LOSSES["gspo"](logp, torch.zeros(2, 3), adv, mask, **CLIP)
    assert torch.allclose(loss, torch.tensor([[-1.28, -1.28, 0.0], [1.0, 1.0, 1.0]]), atol=1e-6)
    assert torch.isclose(stats["clipfrac"], torch.tensor(2 / 5))  # both real tokens of row 0
    assert torch.isclose(stats["ratio_max"], torch.tensor(math.exp(0.3)))


def test_gspo_token_gradient_equals_the_sequence_level_gradient():
    # Unclipped regime: GSPO's objective is -A_i s_i with s_i = exp(mean_t log r); with per-sequence
    # advantages and seq-mean-token-mean aggregation the token form must give the same gradient.
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float64)
    old = torch.randn(3, 4, dtype=torch.float64)
    logp = (old + 0.01 * torch.randn(3, 4, dtype=torch.float64)).requires_grad_()
    seq_adv = torch.tensor([0.7, -1.2, 0.4], dtype=torch.float64)
    adv = seq_adv[:, None].expand(3, 4)

    loss_mat, stats = POLICY_LOSSES["gspo"](logp, old, adv, mask, clip_low=0.5, clip_high=0.5, dual_clip_c=None)
    assert stats["clipfrac"].item() == 0.0
    aggregate(loss_mat, mask, "seq-mean-token-mean", global_tokens=mask.sum(), global_seqs=3).backward()
    token_form = logp.grad.clone()

    logp.grad = None
    seq_log_ratio = ((logp - old) * mask).sum(-1) / mask.sum(-1)
    (-(seq_adv * torch.exp(seq_log_ratio)).sum() / 3).backward()
    assert torch.allclose(token_form, logp.grad, atol=1e-12)


@pytest.mark.parametrize("name", ["ppo", "gspo"])  # the losses with a dual clip
def test_bad_clip_settings_are_config_errors(name):
    x = torch.zeros(1, 1)
    with pytest.raises(ConfigError, match="dual_clip_c"):
        POLICY_LOSSES[name](x, x, x, torch.ones(1, 1), clip_low=0.2, clip_high=0.2, dual_clip_c=0.5)
    with pytest.raises(ConfigError, match="clip_ratio_low"):
        POLICY_LOSSES[name](x, x, x, torch.ones(1, 1), clip_low=1.5, clip_high=0.2, dual_clip_c=None)
