"""The layer pieces of every native family, written once: the training decoder and the rollout engine
both run these functions, so a family added here is right in both (parity by construction).

A layer is `pre_attention` -> an attention core -> `post_attention`. Only the core differs between callers:
the decoder attends with a mask or the varlen kernel (attention.py), the engine over its slot KV pool
(rollout/runner.py, rollout/kernels.py). What differs between families is data, not code paths:
`LayerSpec` (from DecoderConfig: norm placement and rounding, activation, qk-norm, attention scale, window)
and `LayerWeights` (the layer's tensors; a projection is either a tensor, applied with F.linear, or a module,
called: the decoder passes its nn.Linear modules so that anything wrapping them, such as adapters, is
honoured; the engine passes its fused [q; k; v] and [gate; up] copies).
Not here: attention cores and masks (attention.py), RoPE tables (rope.py), modules and names (decoder.py).

Legend: N any leading token dims ([B, T] or [N]), H hidden, Hq/Hkv heads, D head_dim, I MLP width,
L layers, P Gemma 4's per-layer input width.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from phaserl.models import invariant
from phaserl.models.config import DecoderConfig
from phaserl.models.moe import MoESpec, MoEWeights, Route, moe_mlp

Tensor = torch.Tensor
Linear = Union[Tensor, nn.Module]  # a weight [out, in] (F.linear) or a module called on x


@dataclass(frozen=True)
class LayerSpec:
    """The constants of one layer's math (hashable: compiled code specializes on it)."""
    heads: tuple[int, int, int]     # (Hq, Hkv, D)
    eps: float
    norm_style: str                 # config.NORM_STYLES
    qk_norm: str                    # "" | "head" | "projection"
    act: str                        # config.ACTIVATIONS
    scale: Optional[float]          # attention scale; None = D ** -0.5
    window: Optional[int]           # sliding window (keys seen, own included); None = full attention
    local_rope: bool                # takes the sliding layers' RoPE table (Gemma 3)
    moe: Optional[MoESpec] = None   # a mixture of experts instead of the gated MLP (moe.py)
    v_norm: bool = False            # values RMS-normed per head without a weight (Gemma 4)
    kv_shared: bool = False         # queries only: the keys/values are an earlier layer's (Gemma 4, cfg.kv_source)


def layer_spec(cfg: DecoderConfig, layer: int) -> LayerSpec:
    scale = None if cfg.query_pre_attn_scalar is None else float(cfg.query_pre_attn_scalar) ** -0.5
    moe = MoESpec(cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) if cfg.is_moe(layer) else None
    return LayerSpec(cfg.heads(layer), cfg.rms_norm_eps,
                     cfg.norm_style, cfg.qk_norm_scope if cfg.qk_norm else "", cfg.hidden_act, scale,
                     cfg.window(layer), cfg.local_rope(layer), moe=moe, v_norm=cfg.v_norm,
                     kv_shared=cfg.kv_source(layer) != layer)


class LayerWeights(NamedTuple):
    """One layer's parameters; None where the family has none. Either q/k/v or qkv is set (gate/up or gate_up);
    with q/k set and v None the values are the keys' projection (Gemma 4's attention_k_eq_v layers)."""
    attn_in: Optional[Tensor]       # norm before attention (pre, sandwich)
    q: Optional[Linear]
    k: Optional[Linear]
    v: Optional[Linear]
    qkv: Optional[Tensor]           # [(Hq + 2 Hkv) D, H] fused copy
    qkv_bias: Optional[Tensor]      # [(Hq + 2 Hkv) D]
    q_norm: Optional[Tensor]        # [D] per head, or [Hq D] over the projection
    k_norm: Optional[Tensor]
    o: Linear
    o_bias: Optional[Tensor]        # with a tensor `o` only (a module carries its own)
    attn_out: Optional[Tensor]      # norm of the attention output (sandwich, post)
    mlp_in: Optional[Tensor]        # norm before the MLP (pre, sandwich)
    gate: Optional[Linear]
    up: Optional[Linear]
    gate_up: Optional[Tensor]       # [2 I, H] fused copy
    down: Linear
    mlp_out: Optional[Tensor]       # norm of the MLP output (sandwich, post)
    moe: Optional[MoEWeights] = None  # router and stacked experts (gate/up/down are then None)
    layer_scalar: Optional[Tensor] = None  # [1]: the layer's output is scaled by it (Gemma 4)
    ple_gate: Optional[Linear] = None      # [P, H] Gemma 4's per-layer input gate (add_per_layer_input)
    ple_proj: Optional[Linear] = None      # [H, P] its projection back to the residual stream
    ple_norm: Optional[Tensor] = None      # [H] the norm of that projection


def rms_norm(x: Tensor, weight: Optional[Tensor], eps: float, style: str = "llama") -> Tensor:
    """Statistics in float32 for every style; they differ in where the weight meets the rounding:
    llama  weight * norm(x).to(dtype)        olmo2  (weight * norm(x)).to(dtype) (also Gemma 4)
    gemma  (norm(x) * (1 + weight)).to(dtype), the weight stored as an offset from 1.
    weight None: norm(x).to(dtype), no weight (Gemma 4's value norm)."""
    if invariant.enabled():  # the bitwise numerics mode: batch-invariant kernels (invariant.py)
        return invariant.rms_norm(x, weight, eps, style, default=rms_norm)
    x32 = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    if weight is None:
        return x32.to(x.dtype)
    if style == "llama":
        return weight * x32.to(x.dtype)
    if style == "gemma":
        return (x32 * (1.0 + weight.float())).to(x.dtype)
    return (weight * x32).to(x.dtype)


def embed(ids: Tensor, weight: Tensor, scale: Optional[float]) -> Tensor:
    """Token embeddings [N, H]; Gemma multiplies them by sqrt(H), rounded to the weight dtype first."""
    h = F.embedding(ids, weight)
    return h if scale is None else h * torch.tensor(scale, dtype=h.dtype)


def per_layer_inputs(ids: Tensor, h: Tensor, table: Tensor, projection: Linear, norm: Tensor, eps: float,
                     style: str) -> Tensor:
    """Gemma 4's per-layer inputs [N, L, P] for tokens ids [N] embedded as h [N, H]: the token's row of the
    per-layer table [V, L P] (times sqrt(P)) and the projection of h [L P, H] (times H^-0.5, RMS-normed per
    layer), summed and scaled by 2^-0.5. Layer i reads [:, i] (add_per_layer_input)."""
    P = norm.shape[-1]
    token = embed(ids, table, P ** 0.5).unflatten(-1, (-1, P))  # [N, L, P]
    context = (linear(h, projection) * h.shape[-1] ** -0.5).unflatten(-1, (-1, P))  # [N, L, P]
    return (rms_norm(context, norm, eps, style) + token) * 2 ** -0.5


def add_per_layer_input(h: Tensor, p: Tensor, w: LayerWeights, spec: LayerSpec) -> Tensor:
    """h [N, H] plus norm(proj(act(gate(h)) * p)), p [N, P] the layer's own input (per_layer_inputs)."""
    g = activation(linear(h, w.ple_gate), spec.act) * p  # [N, P]
    return h + rms_norm(linear(g, w.ple_proj), w.ple_norm, spec.eps, spec.norm_style)


def linear(x: Tensor, w: Linear, bias: Optional[Tensor] = None, residual: Optional[Tensor] = None) -> Tensor:
    """x @ w.T (+ bias) (+ residual); a 2-d residual add rides in the matmul (addmm)."""
    if invariant.enabled():
        return invariant.linear(x, w, bias, residual)
    if isinstance(w, nn.Module):
        y = w(x)
        return y if residual is None else residual + y
    if residual is not None and bias is None and x.dim() == 2:
        return torch.addmm(residual, x, w.t())
    y = F.linear(x, w, bias)
    return y if residual is None else residual + y


def rope_tables(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """(cos, signed sin) [..., D] so that RoPE is x * cos + roll(x, D/2) * signed_sin (see rotate)."""
    half = cos.shape[-1] // 2
    sign = torch.cat([-torch.ones(half, device=sin.device), torch.ones(half, device=sin.device)]).to(sin.dtype)
    return cos, sin * sign


def rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """RoPE on x [..., heads, D] with tables [..., D]: rotate_half(x) * sin == roll(x, D/2) * signed_sin, exactly."""
    if invariant.enabled():
        return invariant.rotate(x, cos, signed_sin)
    return torch.addcmul(x * cos[..., None, :], x.roll(x.shape[-1] // 2, dims=-1), signed_sin[..., None, :])


def pre_attention(h: Tensor, w: LayerWeights, spec: LayerSpec, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor,
                                                                                                    Tensor]:
    """h [N, H] -> q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D]: input norm, projections, qk-norm, RoPE.
    cos/sin are rope_tables(...) [N, D]."""
    Hq, Hkv, D = spec.heads
    x = h if w.attn_in is None else rms_norm(h, w.attn_in, spec.eps, spec.norm_style)
    if spec.kv_shared:  # the caller brings the keys/values of the layer it shares them with
        return query_only(x, w, spec, cos, sin), None, None
    if w.qkv is not None:
        q, k, v = F.linear(x, w.qkv, w.qkv_bias).split([Hq * D, Hkv * D, Hkv * D], dim=-1)  # [N, heads * D] each
    elif invariant.enabled() and w.v is not None:  # the bitwise mode: one launch where Triton runs (same bits)
        q, k, v = invariant.linears(x, (w.q, w.k, w.v))
    else:
        q, k = linear(x, w.q), linear(x, w.k)
        v = k if w.v is None else linear(x, w.v)  # Gemma 4's k_eq_v layers: the values are the raw keys
    if spec.qk_norm == "projection":  # OLMo 2: over all heads at once
        q, k = rms_norm(q, w.q_norm, spec.eps, spec.norm_style), rms_norm(k, w.k_norm, spec.eps, spec.norm_style)
    q, k, v = q.unflatten(-1, (Hq, D)), k.unflatten(-1, (Hkv, D)), v.unflatten(-1, (Hkv, D))
    if spec.qk_norm == "head":  # Qwen3, Gemma 3: each head on its own
        q, k = rms_norm(q, w.q_norm, spec.eps, spec.norm_style), rms_norm(k, w.k_norm, spec.eps, spec.norm_style)
    if spec.v_norm:
        v = rms_norm(v, None, spec.eps)
    if invariant.enabled():  # the bitwise mode: queries and keys in one launch where Triton runs (same bits)
        return (*invariant.rotate_pair(q, k, cos, sin), v)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def query_only(x: Tensor, w: LayerWeights, spec: LayerSpec, cos: Tensor, sin: Tensor) -> Tensor:
    """A KV-sharing layer's queries [N, Hq, D] from its normed input x [N, H] (qkv: the engine's q rows alone)."""
    Hq, _, D = spec.heads
    assert spec.qk_norm != "projection", "KV-sharing layers take per-head q-norms (Gemma 4) or none"
    q = (linear(x, w.q) if w.qkv is None else F.linear(x, w.qkv, w.qkv_bias)).unflatten(-1, (Hq, D))
    if spec.qk_norm == "head":
        q = rms_norm(q, w.q_norm, spec.eps, spec.norm_style)
    return rotate(q, cos, sin)


def activation(gate: Tensor, act: str) -> Tensor:
    if invariant.enabled():
        return invariant.activation(gate, act)
    return F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")


def post_attention(h: Tensor, attn: Tensor, w: LayerWeights, spec: LayerSpec, route: Optional[Route] = None,
                   per_layer_input: Optional[Tensor] = None) -> Tensor:
    """Residual stream after the attention core: h [N, H], attn [N, Hq * D] -> h [N, H]
    (o_proj, its output norm, residual, MLP input norm, gated MLP or experts, its output norm, residual, then
    Gemma 4's per-layer input [N, P] where the layer has one, and its layer scalar).
    route: a MoE layer's routing in/out (moe.Route: replayed experts, the experts and router logits used)."""
    if w.attn_out is None:
        h = linear(attn, w.o, w.o_bias, residual=h)
    else:
        h = h + rms_norm(linear(attn, w.o, w.o_bias), w.attn_out, spec.eps, spec.norm_style)
    x = h if w.mlp_in is None else rms_norm(h, w.mlp_in, spec.eps, spec.norm_style)
    if spec.moe is not None:
        y = moe_mlp(x, w.moe, spec.moe, route)
        return h + (y if w.mlp_out is None else rms_norm(y, w.mlp_out, spec.eps, spec.norm_style))
    if w.gate_up is not None:
        gate, up = F.linear(x, w.gate_up).chunk(2, dim=-1)  # [N, I] each
    elif invariant.enabled():  # the bitwise mode: one launch where Triton runs (same bits)
        gate, up = invariant.linears(x, (w.gate, w.up))
    else:
        gate, up = linear(x, w.gate), linear(x, w.up)
    a = invariant.gated(gate, up, spec.act) if invariant.enabled() else activation(gate, spec.act) * up
    if w.mlp_out is None:
        h = linear(a, w.down, residual=h)
    else:
        h = h + rms_norm(linear(a, w.down), w.mlp_out, spec.eps, spec.norm_style)
    if w.ple_gate is not None:
        h = add_per_layer_input(h, per_layer_input, w, spec)
    # In h's dtype, as transformers' in-place `h *= layer_scalar` (an fp32 buffer under bf16 compute included).
    return h if w.layer_scalar is None else h * w.layer_scalar.to(h.dtype)
