"""masked_sum / masked_mean / masked_var / masked_whiten read only the real entries."""
import math

import torch

from phaserl.algo import masked_mean, masked_sum, masked_var, masked_whiten

# Real entries: row 0 -> 1, 2; row 1 -> 4. Padding holds garbage (including inf) that must not leak.
X = torch.tensor([[1.0, 2.0, 99.0], [4.0, float("inf"), -7.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_sum_and_mean_ignore_padding():
    assert masked_sum(X, MASK).item() == 7.0  # 1 + 2 + 4
    assert torch.equal(masked_sum(X, MASK, dim=-1), torch.tensor([3.0, 4.0]))
    assert math.isclose(masked_mean(X, MASK).item(), 7 / 3, rel_tol=1e-6)
    assert torch.equal(masked_mean(X, MASK, dim=-1), torch.tensor([1.5, 4.0]))  # 3/2, 4/1


def test_mean_of_an_empty_row_is_zero_not_nan():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert torch.equal(masked_mean(X, mask, dim=-1), torch.tensor([1.5, 0.0]))


def test_var_unbiased_and_biased():
    # values 1, 2, 4: mean 7/3, deviations -4/3, -1/3, 5/3, squares sum to (16 + 1 + 25)/9 = 14/3
    assert math.isclose(masked_var(X, MASK).item(), (14 / 3) / 2, rel_tol=1e-6)  # / (n - 1)
    assert math.isclose(masked_var(X, MASK, unbiased=False).item(), (14 / 3) / 3, rel_tol=1e-6)  # / n
    # per row: row 0 {1, 2}: mean 1.5, squares 0.25 + 0.25 = 0.5, / 1; row 1 {4}: one value -> 0, not nan
    assert torch.allclose(masked_var(X, MASK, dim=-1), torch.tensor([0.5, 0.0]))


def test_whiten_over_the_batch_zeroes_padding():
    out = masked_whiten(X, MASK)
    std = math.sqrt(7 / 3)  # unbiased variance from above
    expected = torch.tensor([[(1 - 7 / 3) / std, (2 - 7 / 3) / std, 0.0], [(4 - 7 / 3) / std, 0.0, 0.0]])
    assert torch.allclose(out, expected, atol=1e-6)
    # shift_mean=False keeps the mean: (x - m) / s + m
    kept = masked_whiten(X, MASK, shift_mean=False)
    assert math.isclose(kept[0, 0].item(), (1 - 7 / 3) / std + 7 / 3, rel_tol=1e-6)
    assert kept[1, 1].item() == 0.0
