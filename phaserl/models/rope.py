"""Rotary position embeddings (RoPE) and the context-extension variants Llama/Qwen checkpoints use.

Each variant is a pure function `(cfg) -> (inv_freq [D/2], attention_scaling)` computed once in
float32, following the formulas transformers uses so that logits match bit for bit in float32:
  default  theta^(-2i/D)
  linear   positions divided by `factor` (== inv_freq / factor)
  dynamic  NTK-aware: theta grows with the longest position of the current call (no state kept)
  llama3   Llama 3.1: long wavelengths / factor, short ones kept, a smooth ramp in between
  yarn     NTK-by-parts interpolation + an attention temperature applied to cos/sin
  proportional  Gemma 4's global layers: the first partial_rotary_factor * D / 2 frequencies are
           theta^(-2i/D) (D the whole head_dim), the rest 0 (those dims are not rotated), all / factor
Partial rotary (`cfg.rotary_dim` < head_dim, a rotated prefix of each head) exists for the default variant only
(Qwen3.5).
Not here: longrope, multimodal rope (their configs are rejected in config.py).

Legend: B batch, T tokens, D head_dim.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from phaserl.models.config import DecoderConfig


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    # On the CPU even inside a meta-device context: frequencies are tiny, and meta ops import torch._dynamo.
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))  # [D/2]


def default_rope(cfg: DecoderConfig) -> tuple[torch.Tensor, float]:
    # Partial rotary (Qwen3.5) rotates the first rotary_dim dims: frequencies over that width, tables [.., rotary_dim].
    return _default_inv_freq(cfg.rope_theta, cfg.rotary_dim), 1.0


def linear_rope(cfg: DecoderConfig) -> tuple[torch.Tensor, float]:
    return _default_inv_freq(cfg.rope_theta, cfg.head_dim) / cfg.rope_scaling["factor"], 1.0


def dynamic_rope(cfg: DecoderConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """NTK scaling: unchanged up to max_position_embeddings, a larger theta beyond it."""
    dim, max_pos, factor = cfg.head_dim, cfg.max_position_embeddings, cfg.rope_scaling["factor"]
    seq_len = max(seq_len or max_pos, max_pos)
    theta = cfg.rope_theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return _default_inv_freq(theta, dim), 1.0


def llama3_rope(cfg: DecoderConfig) -> tuple[torch.Tensor, float]:
    s = cfg.rope_scaling
    inv_freq = _default_inv_freq(cfg.rope_theta, cfg.head_dim)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_context = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (> old_context / low) are interpolated by `factor`; short ones (< old_context / high)
    # are kept; the band between mixes the two linearly in old_context / wavelen.
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    mixed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(is_medium, mixed, scaled), 1.0


def yarn_rope(cfg: DecoderConfig) -> tuple[torch.Tensor, float]:
    s, dim, theta = cfg.rope_scaling, cfg.head_dim, cfg.rope_theta
    factor, old_context = s["factor"], s["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    # The dimension whose wavelength completes `rotations` turns within the original context.
    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)  # [D/2]
    extrapolate = 1 - ramp  # 1 for high-frequency dims (kept), 0 for low-frequency dims (interpolated)
    base = _default_inv_freq(theta, dim)
    inv_freq = (base / factor) * (1 - extrapolate) + base * extrapolate
    return inv_freq, float(attention_factor)


def proportional_rope(cfg: DecoderConfig) -> tuple[torch.Tensor, float]:
    s, dim = cfg.rope_scaling, cfg.head_dim
    rotated = int(s.get("partial_rotary_factor", 1.0) * dim // 2)  # frequencies that rotate
    inv_freq = _default_inv_freq(cfg.rope_theta, dim)[:rotated]
    # The rest get angle 0: cos 1, sin 0, so those dims pass unrotated.
    inv_freq = torch.cat([inv_freq, torch.zeros(dim // 2 - rotated, device="cpu")])
    return inv_freq / s.get("factor", 1.0), 1.0


ROPE_FUNCTIONS = {"default": default_rope, "linear": linear_rope, "dynamic": dynamic_rope,
                  "llama3": llama3_rope, "yarn": yarn_rope,
                  "proportional": proportional_rope}


class RotaryEmbedding(nn.Module):
    """Turns position ids into the (cos, sin) tables every attention layer shares."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        inv_freq, self.attention_scaling = ROPE_FUNCTIONS[cfg.rope_type](cfg)
        # Not persistent: derived from the config, never part of a checkpoint.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _inv_freq_for(self, position_ids: torch.Tensor) -> torch.Tensor:
        if self.cfg.rope_type != "dynamic":
            return self.inv_freq
        longest = int(position_ids.max()) + 1  # a host sync, paid only by dynamic-NTK models
        if longest <= self.cfg.max_position_embeddings:
            return self.inv_freq
        return dynamic_rope(self.cfg, longest)[0].to(self.inv_freq.device)

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] -> cos, sin [B, T, D] in `dtype` (angles computed in float32)."""
        # A model built under `with torch.device("cuda")` keeps this CPU-made buffer on the CPU: moved once
        # (a blocking copy every forward is a host sync).
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        inv_freq = self._inv_freq_for(position_ids).to(position_ids.device).float()
        angles = position_ids[..., None].float() * inv_freq  # [B, T, D/2]
        angles = torch.cat((angles, angles), dim=-1)  # [B, T, D]: HF layout, halves not interleaved
        cos = angles.cos() * self.attention_scaling
        sin = angles.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)
