"""Clipped value loss against hand-worked numbers."""
import pytest
import torch

from phaserl.algo import clipped_value_loss
from phaserl.errors import ConfigError


def test_clipped_value_loss_by_hand():
    values = torch.tensor([[1.0, 1.0, 0.2, 50.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    returns = torch.tensor([[2.0, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = clipped_value_loss(values, old, returns, mask, clip_range=0.5)
    # token 0: V_clip = 0.5; (1-2)^2 = 1 < (0.5-2)^2 = 2.25 -> 0.5 * 2.25 = 1.125 (clipped)
    # token 1: V_clip = 0.5; (1-0)^2 = 1 > (0.5-0)^2 = 0.25 -> 0.5 * 1 = 0.5
    # token 2: inside the range, V_clip = V: 0.5 * 0.8^2 = 0.32 (equal errors do not count as clipped)
    assert torch.allclose(loss, torch.tensor([[1.125, 0.5, 0.32, 0.0]]))
    assert torch.isclose(stats["clipfrac"], torch.tensor(1 / 3))
    loss.sum().backward()
    # clipped token has no gradient; token 1: d/dV 0.5 (V - R)^2 = V - R = 1; token 2: 0.2 - 1 = -0.8
    assert torch.allclose(values.grad, torch.tensor([[0.0, 1.0, -0.8, 0.0]]))


def test_negative_clip_range_is_a_config_error():
    with pytest.raises(ConfigError, match="cliprange_value"):
        clipped_value_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), clip_range=-1)
