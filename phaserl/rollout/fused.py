"""The decode step's layer with the Triton kernels: the same math as layers.pre_attention -> attention ->
layers.post_attention, in 7 kernels instead of ~25 (what a 0.5B decode step at 512 rows spends most of its
time launching).

  rms_norm -> [q; k; v] GEMM (no bias) -> attention (bias + qk-norm + RoPE + KV write + split-K attention)
  -> o GEMM with the residual (addmm) -> rms_norm -> [gate; up] GEMM -> act(gate) * up -> down GEMM + residual

Only for the layers whose math is exactly that (pre-norm, fused weights, qk-norm per head or none, nothing
else):
`fusable` says which; every other layer runs layers.py's functions (runner.py). Each kernel rounds where
the torch path rounds, so bf16 results differ from it only by accumulation order (and by the bias, added
after the GEMM's rounding instead of inside its epilogue); tests/test_rollout_fused.py pins that.
The extend pass (multi-turn continuation: M new tokens per row) runs the same layer with extend_kernel.py's
prepare + extend_attention in place of the decode attention (fused_extend_layer): 9 launches a layer instead of
the ~35 of layers.py's functions with the torch attention (an eager extend pass is bound by its launches).
Not here: prefill (runner.py, SDPA), sampling (sample_kernel.sample).

Legend: b decode rows, N tokens (b, or C rows x M tokens of an extend pass), H hidden, Hq/Hkv heads, D head_dim,
S slot_len.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from phaserl.models.layers import LayerSpec, LayerWeights, linear
from phaserl.rollout import extend_kernel, kernels

Tensor = torch.Tensor

# The LayerWeights / LayerSpec fields this module implements; a family that sets anything else (a new norm,
# experts, a layer scale: fields added to layers.py later) is not fusable and keeps the layers.py path.
USED_WEIGHTS = {"attn_in", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "mlp_in", "gate_up", "down"}
USED_SPEC = {"heads", "eps", "norm_style", "act", "scale", "window", "local_rope"}
SPEC_ALLOWED = {"qk_norm": ("", "head")}  # spec fields that must hold one of these values (not "projection")
# True: each residual add rides in its GEMM (addmm); False: the o/down GEMMs write their output alone and the
# next norm kernel adds it to the residual stream. False is faster on an H200 at 512 rows (graph step 2.39 vs
# 2.50 ms): addmm first copies the residual into its output (a DtoD memcpy) and cuBLAS's beta = 1 kernels are
# slower (down 12.3 vs 10.8 us, o 5.9 vs 4.4 us).
RESIDUAL_IN_GEMM = False


def fusable(w: LayerWeights, spec: LayerSpec) -> bool:
    """True when fused_decode_layer computes exactly what layers.pre_attention/post_attention compute, for the
    engine's weights (runner.fused_weights: [q; k; v] and [gate; up] copies, o and down as tensors)."""
    weights_ok = w.qkv is not None and w.gate_up is not None and isinstance(w.o, Tensor) and isinstance(
        w.down, Tensor) and all(getattr(w, f) is None for f in LayerWeights._fields if f not in USED_WEIGHTS)
    return weights_ok and spec_fusable(spec)


def decodes_fused(model) -> bool:
    """True when every decoder layer of `model` (a CausalLM) would decode through fused_decode_layer where the
    kernels run: its modules have the pieces fused_weights concatenates and nothing fusable() refuses."""
    for layer in model.model.layers:
        if not (hasattr(layer, "weights") and hasattr(layer, "spec")):  # another kind of layer (linear attention)
            return False
        w = layer.weights()  # the modules: q/k/v and gate/up separate, fused by runner.fused_weights
        parts = (w.q, w.k, w.v, w.gate, w.up, w.o, w.down)
        rest = (getattr(w, f) for f in LayerWeights._fields if f not in USED_WEIGHTS | {"q", "k", "v", "gate", "up"})
        if any(p is None for p in parts) or any(r is not None for r in rest) or not spec_fusable(layer.spec):
            return False
    return True


def spec_fusable(spec: LayerSpec) -> bool:
    return spec.act in ("silu", "gelu_pytorch_tanh") and all(
        getattr(spec, f) in SPEC_ALLOWED[f] if f in SPEC_ALLOWED else getattr(spec, f) in (None, False, 0)
        for f in spec.__dataclass_fields__ if f not in USED_SPEC)


def add_norm(h: Tensor, carry: Optional[Tensor], weight: Optional[Tensor], spec: LayerSpec) -> tuple[Tensor, Tensor]:
    """(the sublayer's input, the residual stream) from h plus a pending sublayer output `carry` (or None)."""
    if weight is None:
        h = h if carry is None else h + carry
        return h, h
    if carry is None:
        return kernels.rms_norm(h, weight, spec.eps, spec.norm_style), h
    return kernels.add_rms_norm(carry, h, weight, spec.eps, spec.norm_style)


def fused_decode_layer(h: Tensor, carry: Optional[Tensor], w: LayerWeights, spec: LayerSpec, keys: Tensor,
                       values: Tensor, pos: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    """(h [b, H], carry) -> (h, carry) after one layer, where the residual stream is h + carry (carry: the last
    MLP output not added yet, or None; see RESIDUAL_IN_GEMM). Writes the rows' k/v at pos [b] into keys/values
    [slots, Hkv, S, D]. cos/sin: the layer's layers.rope_tables over all positions [S, D] (indexed in the kernel)."""
    Hq, Hkv, D = spec.heads

    def attend(q: Tensor, k: Tensor, v: Tensor, bias, qk_norm) -> Tensor:
        b = q.shape[0]
        return kernels.decode_attention(q.view(b, Hq, D), k.view(b, Hkv, D), v.view(b, Hkv, D), keys, values, pos,
                                        spec.scale, spec.window, bias=bias, rope=(cos, sin), qk_norm=qk_norm)
    return _fused_layer(h, carry, w, spec, attend)


def fused_extend_layer(h: Tensor, carry: Optional[Tensor], w: LayerWeights, spec: LayerSpec, keys: Tensor,
                       values: Tensor, slots: Tensor, pos: Tensor, lengths: Tensor, context: int, cos: Tensor,
                       sin: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    """The extend pass's layer in the same kernels (h [C * M, H], carry as fused_decode_layer's), its attention
    extend_kernel.py's: prepare (biases, qk-norm, RoPE, the k/v write at (slots[r], :, pos[r, j]) for pos [C, M])
    and extend_attention over each row's slot below `context` (lengths [C]: real tokens per row)."""
    Hq, Hkv, D = spec.heads

    def attend(q: Tensor, k: Tensor, v: Tensor, bias, qk_norm) -> Tensor:
        n = q.shape[0]
        q = extend_kernel.prepare(q.view(n, Hq, D), k.view(n, Hkv, D), v.view(n, Hkv, D), keys, values, slots, pos,
                                  rope=(cos, sin), bias=bias, qk_norm=qk_norm)  # [n, Hq, D]
        return extend_kernel.extend_attention(q, keys, values, slots, pos, lengths, context, spec.scale, spec.window)
    return _fused_layer(h, carry, w, spec, attend)


def _fused_layer(h: Tensor, carry: Optional[Tensor], w: LayerWeights, spec: LayerSpec,
                 attend) -> tuple[Tensor, Optional[Tensor]]:
    """The layer around its attention: attend(q, k, v, bias, qk_norm) [N, Hq * D] from the raw [q; k; v] GEMM's
    views (no bias: `bias` are the three bias vectors or None, `qk_norm` (q_norm, k_norm, eps, style) or None)."""
    Hq, Hkv, D = spec.heads
    x, h = add_norm(h, carry, w.attn_in, spec)
    q, k, v = F.linear(x, w.qkv).split([Hq * D, Hkv * D, Hkv * D], dim=-1)  # [N, heads * D] views, no bias
    bias = None if w.qkv_bias is None else w.qkv_bias.split([Hq * D, Hkv * D, Hkv * D])
    qk_norm = (w.q_norm, w.k_norm, spec.eps, spec.norm_style) if spec.qk_norm == "head" else None
    attn = attend(q, k, v, bias, qk_norm)  # [N, Hq * D]
    if RESIDUAL_IN_GEMM:
        x, h = add_norm(linear(attn, w.o, w.o_bias, residual=h), None, w.mlp_in, spec)
    else:
        x, h = add_norm(h, linear(attn, w.o, w.o_bias), w.mlp_in, spec)
    a = kernels.gated(F.linear(x, w.gate_up), spec.act)  # [N, I]
    if RESIDUAL_IN_GEMM:
        return linear(a, w.down, residual=h), None
    return h, linear(a, w.down)
