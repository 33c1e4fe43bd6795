"""The parameter-holding modules that every decoder layer kind shares: RMSNorm and the gated MLP.

They hold parameters under transformers' names and call the math in layers.py; the layer kinds that use them
(decoder.DecoderLayer, hybrid.HybridLayer) import them from here, so neither needs the other.
Not here: the layer math (layers.py), attention and MoE modules (decoder.py), Qwen3.5's layer (hybrid.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from phaserl.models.config import DecoderConfig
from phaserl.models.layers import rms_norm


class RMSNorm(nn.Module):
    """layers.rms_norm with this module's weight; `style` says how the weight meets the rounding."""

    def __init__(self, dim: int, eps: float, style: str = "llama"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.style = eps, style

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.style)



class MLP(nn.Module):
    """The gated MLP's parameters: down(act(gate(x)) * up(x)), act = silu (SwiGLU) or gelu-tanh (GeGLU)."""

    def __init__(self, cfg: DecoderConfig, width: Optional[int] = None):
        super().__init__()
        width = width or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)
