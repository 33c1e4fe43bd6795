"""Loss aggregation: hand-worked values, and gradients that do not depend on the micro-batch split."""
import pytest
import torch

from phaserl.algo import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    ROLLOUT_CORRECTIONS,
    aggregate,
    bind_policy_loss,
    rollout_correction,
    token_logprobs_from_logits,
)
from phaserl.algo.masked import masked_mean
from phaserl.errors import ConfigError

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, float("nan")]])  # row 1 has one real token
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 2.5),  # (1 + 2 + 3 + 4) / 4 tokens
    ("seq-mean-token-sum", 5.0),  # (6 + 4) / 2 responses
    ("seq-mean-token-mean", 3.0),  # (6/3 + 4/1) / 2
    ("seq-mean-token-sum-norm", 1.0),  # 10 / (2 responses * max_len 5)
    ("token-sum", 10.0),  # 1 + 2 + 3 + 4, no denominator
])
def test_modes_by_hand(mode, expected):
    out = aggregate(LOSS, MASK, mode, global_tokens=4, global_seqs=2, max_len=5)
    assert out.item() == pytest.approx(expected)


def test_unknown_mode_and_missing_max_len_are_errors():
    with pytest.raises(ConfigError, match="token-mean"):
        aggregate(LOSS, MASK, "mean", global_tokens=4, global_seqs=2)
    with pytest.raises(ConfigError, match="max_new_tokens"):
        aggregate(LOSS, MASK, "seq-mean-token-sum-norm", global_tokens=4, global_seqs=2)


# A tiny linear "policy": logits = features @ W.T, so the gradient lands on one [V, H] parameter.
B, T, H, V, MAX_LEN = 8, 6, 4, 7, 6
LENGTHS = [6, 2, 5, 1, 3, 6, 4, 2]
SPLIT = [1, 3, 2, 2]  # uneven micro-batches, each trimmed to its own longest response


def _batch():
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).double()  # [B, T]
    adv = torch.randn(B, T, generator=g, dtype=torch.float64) * mask
    weight0 = torch.randn(V, H, generator=g, dtype=torch.float64)
    # Old log-probs of a slightly different policy, so that some tokens are clipped.
    with torch.no_grad():
        old = token_logprobs_from_logits(feats @ (weight0 + 0.3 * torch.randn(V, H, generator=g,
                                                                              dtype=torch.float64)).t(), targets)
    return feats, targets, mask, adv, old, weight0


HYPER = dict(clip_low=0.2, clip_high=0.28, dual_clip_c=3.0, tau_pos=1.0, tau_neg=1.05, beta=0.1, delta_low=0.1,
             delta_high=0.1, ratio_cap=20.0)


def _micro_loss(weight, feats, targets, mask, adv, old, mode, n_tokens, n_seqs, loss="ppo", correction=None):
    width = int(mask.sum(-1).max())  # trim padding: the width must not matter either
    feats, targets, mask, adv, old = (x[:, :width] for x in (feats, targets, mask, adv, old))
    logp = token_logprobs_from_logits(feats @ weight.t(), targets)  # [b, width]
    loss_mat, _ = bind_policy_loss(loss, **HYPER)(logp, old, adv, mask)
    if correction is not None:  # the rollout's log-probs: the old ones, perturbed
        rollout = old + 0.4 * torch.sin(7.0 * old)
        loss_mat = loss_mat * rollout_correction(old, rollout, mask, mode=correction, cap=1.3)[0]
    return aggregate(loss_mat, mask, mode, global_tokens=n_tokens, global_seqs=n_seqs, max_len=MAX_LEN)


CASES = ([(mode, "ppo", None) for mode in LOSS_AGG_MODES] + [("token-mean", name, None) for name in POLICY_LOSSES]
         + [("token-sum", name, None) for name in POLICY_LOSSES]
         + [("seq-mean-token-mean", name, fix) for name in ("ppo", "gmpo") for fix in ROLLOUT_CORRECTIONS])


@pytest.mark.parametrize("mode, loss, correction", CASES)
def test_gradient_does_not_depend_on_the_micro_batch_split(mode, loss, correction):
    feats, targets, mask, adv, old, weight0 = _batch()
    n_tokens, n_seqs = mask.sum().item(), B
    extra = dict(loss=loss, correction=correction)

    whole = weight0.clone().requires_grad_()
    full_loss = _micro_loss(whole, feats, targets, mask, adv, old, mode, n_tokens, n_seqs, **extra)
    full_loss.backward()

    split = weight0.clone().requires_grad_()
    total, start = 0.0, 0
    for size in SPLIT:
        rows = slice(start, start + size)
        micro = _micro_loss(split, feats[rows], targets[rows], mask[rows], adv[rows], old[rows], mode,
                            n_tokens, n_seqs, **extra)
        micro.backward()  # gradients accumulate, as in gradient accumulation
        total += micro.item()
        start += size

    assert total == pytest.approx(full_loss.item(), abs=1e-10)
    assert torch.allclose(split.grad, whole.grad, atol=1e-6)
    assert whole.grad.abs().sum() > 0


def test_averaging_per_micro_batch_means_would_depend_on_the_split():
    # The mistake the global denominators prevent: mean per micro-batch, then mean of those means.
    feats, targets, mask, adv, old, weight0 = _batch()
    whole = weight0.clone().requires_grad_()
    logp = token_logprobs_from_logits(feats @ whole.t(), targets)
    masked_mean(-adv * logp, mask).backward()

    naive = weight0.clone().requires_grad_()
    start = 0
    for size in SPLIT:
        rows = slice(start, start + size)
        logp = token_logprobs_from_logits(feats[rows] @ naive.t(), targets[rows])
        (masked_mean(-adv[rows] * logp, mask[rows]) / len(SPLIT)).backward()
        start += size
    assert not torch.allclose(naive.grad, whole.grad, atol=1e-3)
