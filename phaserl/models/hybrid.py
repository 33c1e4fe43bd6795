"""Qwen3.5's decoder layer: a Gated DeltaNet layer (linear_attention.py) or gated full attention, then the MLP.

Both kinds are pre-norm with `x * (1 + w)` norms and end in layers.post_attention (output projection,
residual, MLP, residual). The full-attention kind differs from Qwen3's in three places:
  output gate   q_proj yields [q; gate] per head (2 D each); the attention output is multiplied by sigmoid(gate)
                before o_proj
  partial RoPE  only the first rotary_dim = head_dim * partial_rotary_factor dims of q and k rotate
  qk-norm       per head, (1 + w) style
Qwen3.5's multimodal RoPE (mrope_section) gives text tokens the same position on its three axes, which
is plain RoPE: the text model needs nothing else. `gated_pre_attention` / `gated_output` are shared with
the rollout engine (rollout/recurrent_state.py), so training and rollout run one definition.
Not here: the DeltaNet math (linear_attention.py), the attention cores (attention.py), the KV cache (the
decoder's KVCache holds no recurrent state: cached decoding is the rollout engine's).

Legend: B batch, T tokens, N any leading token dims, H hidden, Hq/Hkv heads, D head_dim, R rotary_dim.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from phaserl.models import attention
from phaserl.models.config import DecoderConfig
from phaserl.models.layers import LayerSpec, LayerWeights, layer_spec, linear, post_attention, rms_norm, rotate
from phaserl.models.linear_attention import GatedDeltaNet, Segments
from phaserl.models.modules import MLP, RMSNorm

Tensor = torch.Tensor


class GatedAttention(nn.Module):
    """Full attention's parameters: q_proj [2 Hq D, H] ([q; gate] per head), k/v/o, per-head q/k norms."""

    def __init__(self, cfg: DecoderConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        Hq, Hkv, H, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(H, 2 * Hq * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(H, Hkv * D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(H, Hkv * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(Hq * D, H, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps, cfg.norm_style)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps, cfg.norm_style)


def rotate_partial(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on the first R dims of x [..., heads, D]; cos/sin are layers.rope_tables [..., R]."""
    R = cos.shape[-1]
    if R == x.shape[-1]:
        return rotate(x, cos, sin)
    return torch.cat([rotate(x[..., :R], cos, sin), x[..., R:]], dim=-1)


def gated_pre_attention(h: Tensor, w: LayerWeights, spec: LayerSpec, cos: Tensor,
                        sin: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """h [N, H] -> q [N, Hq, D], k/v [N, Hkv, D], gate [N, Hq * D]: input norm, projections, qk-norm, partial RoPE.
    w.q is q_proj (a module or a [2 Hq D, H] tensor); cos/sin [N, R]."""
    Hq, Hkv, D = spec.heads
    x = rms_norm(h, w.attn_in, spec.eps, spec.norm_style)
    q, gate = linear(x, w.q).unflatten(-1, (Hq, 2 * D)).chunk(2, dim=-1)  # [N, Hq, D] each
    k, v = linear(x, w.k).unflatten(-1, (Hkv, D)), linear(x, w.v).unflatten(-1, (Hkv, D))
    q, k = rms_norm(q, w.q_norm, spec.eps, spec.norm_style), rms_norm(k, w.k_norm, spec.eps, spec.norm_style)
    return rotate_partial(q, cos, sin), rotate_partial(k, cos, sin), v, gate.flatten(-2)


def gated_output(h: Tensor, attn: Tensor, gate: Tensor, w: LayerWeights, spec: LayerSpec) -> Tensor:
    """attn [N, Hq * D] * sigmoid(gate), then layers.post_attention (o_proj, residual, MLP): -> h [N, H]."""
    return post_attention(h, attn * torch.sigmoid(gate), w, spec)


class HybridLayer(nn.Module):
    """One Qwen3.5 layer; `linear` says which kind. Parameter names are transformers' (`linear_attn.*` or
    `self_attn.*`, `mlp.*`, `input_layernorm`, `post_attention_layernorm`)."""

    def __init__(self, cfg: DecoderConfig, layer_idx: int):
        super().__init__()
        self.spec = layer_spec(cfg, layer_idx)
        self.linear = cfg.is_linear(layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_style)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_style)
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.compiled: Optional[str] = None  # enable_compile(): the torch.compile backend, where COMPILE_HYBRID

    @property
    def attn_key(self):
        """What the layer reads from the decoder's per-forward attention inputs: Segments, or the mask of its window."""
        return "linear" if self.linear else self.spec.window

    def weights(self) -> LayerWeights:
        """Norms, projections and MLP for layers.py (q: q_proj with its gate rows; o: o_proj or out_proj)."""
        m = self.mlp
        a = self.linear_attn if self.linear else self.self_attn
        return LayerWeights(
            attn_in=self.input_layernorm.weight, q=None if self.linear else a.q_proj,
            k=None if self.linear else a.k_proj, v=None if self.linear else a.v_proj, qkv=None, qkv_bias=None,
            q_norm=None if self.linear else a.q_norm.weight, k_norm=None if self.linear else a.k_norm.weight,
            o=a.out_proj if self.linear else a.o_proj, o_bias=None, attn_out=None,
            mlp_in=self.post_attention_layernorm.weight, gate=m.gate_proj, up=m.up_proj, gate_up=None,
            down=m.down_proj, mlp_out=None)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, attn: Union[Tensor, attention.PackedSeqs, Segments],
                kv_cache=None, route=None) -> Tensor:
        """h [B, T, H] -> [B, T, H]; `attn` is Segments for a linear layer, a mask or PackedSeqs otherwise.
        route: a mixture-of-experts layer's replayed routing, which Qwen3.5's dense MLP never has (always None)."""
        if kv_cache is not None:
            raise NotImplementedError("Qwen3.5 (linear attention) decodes with the rollout engine "
                                      "(phaserl.rollout.RolloutEngine); the decoder's KVCache holds no recurrent state")
        if self.compiled:  # the module call (and any FSDP hook on it) stays outside torch.compile, as DecoderLayer's
            return compiled_block(self.compiled)(self, h, cos, sin, attn)
        return hybrid_block(self, h, cos, sin, attn)


def hybrid_block(layer: HybridLayer, h: Tensor, cos: Tensor, sin: Tensor,
                 attn: Union[Tensor, attention.PackedSeqs, Segments]) -> Tensor:
    """One Qwen3.5 layer: h [B, T, H] -> [B, T, H]. Under torch.compile the attention core and the delta rule
    (linear_attention.delta_rule_tokens) stay eager, like DecoderLayer's attention: projections, the short
    convolution, the norms, gates and the MLP are what compiles."""
    w = layer.weights()
    if layer.linear:
        x = rms_norm(h, w.attn_in, layer.spec.eps, layer.spec.norm_style)
        return post_attention(h, layer.linear_attn(x, attn), w, layer.spec)
    q, k, v, gate = gated_pre_attention(h, w, layer.spec, cos, sin)  # [B, T, heads, D], gate [B, T, Hq * D]
    out = _attend(q, k, v, attn, layer.spec.scale)  # [B, T, Hq, D]
    return gated_output(h, out.flatten(-2), gate, w, layer.spec)


# enable_compile (decoder.py) compiles the hybrid layers too only where this is True. Off: measured on the H200
# (2026-12-03, `benchmarks/families.py --shape qwen35-2b --case train_layers`: one packed micro-batch of 8 x 384
# tokens, the whole model's forward + backward) compiled took 429.9 ms against eager's 311.5 (0.73x; its first call
# 37 s). Eager at that micro-batch was host-bound (device busy 0.38: ~12,700 kernels); phaserl's default micro-batch
# (ppo.micro_batch_tokens=16384) amortizes the launches instead: the 2B GRPO step 30.38 s -> 19.61 s.
COMPILE_HYBRID = False


@torch.compiler.disable  # the attention core as without compile (varlen kernel or SDPA), kept out of the graph
def _attend(q: Tensor, k: Tensor, v: Tensor, attn, scale) -> Tensor:
    return attention.attend(q, k, v, attn, scale)  # looked up at call time: what attention.attend is then


_COMPILED: dict = {}  # backend -> torch.compile(hybrid_block), made once per process


def compiled_block(backend: str):
    """torch.compile(hybrid_block) for `backend` (dynamic shapes: one graph per layer kind serves every batch)."""
    if backend not in _COMPILED:
        from ..compile_cache import guard_compiled, specialize_floats  # a corrupt cache: moved aside, cold

        specialize_floats()  # the norms' eps constants: no restarted compiles (compile_cache.py)
        _COMPILED[backend] = guard_compiled(torch.compile(hybrid_block, dynamic=True, backend=backend))
    return _COMPILED[backend]
