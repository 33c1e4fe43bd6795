"""Batch-invariant kernels: the bitwise numerics mode (rollout.bitwise), in which the trainer's log-prob of every
sampled token equals the rollout engine's bit for bit.

A token's values go through the same sequence of correctly rounded operations whatever else shares the call: how
many rows, where the token sits in a packed row, and whether it runs in the engine's prefill, its decode step over
the KV slots or the trainer's whole-sequence forward. The rules that make it so, on any device:
  - only elementwise torch ops (mul, add, div, sqrt, exp, log, tanh: each element exactly rounded, whatever the
    shape of the call), gathers and copies, and `amax` (exact in any order);
  - every sum is `tree_sum`: a pairwise tree over a length the model fixes (matmul depth K, hidden size, head dim,
    vocabulary), never a library reduction whose blocking may depend on the shape;
  - attention sums over KEY_BLOCK key positions at a time, blocks aligned at position 0 of the sequence: a tree
    inside a block, a left fold over blocks. Keys past a query's position weigh exactly 0, so a decode step over a
    slot of S positions adds the same numbers in the same order as the training forward over the sequence;
  - activations that torch computes differently in its vectorized and scalar CPU loops (silu, sigmoid, gelu) are
    written from ones that do not (exp, tanh, division), checked in tests/test_bitwise.py.
Gradients need no bitwise equality: the trainer's forward takes its values from these kernels and its graph from a
default forward (roles/forward.py, exact_values); elsewhere a kernel's backward is the default one's (`_exact`).
Matmul inputs of 16-bit floats multiply exactly in float32; every kernel accumulates in float32 and rounds to the
input dtype where the default kernel does. Cost: a matmul holds its [rows, N, K] products (in chunks of
CHUNK_ELEMENTS), a memory-bound pass instead of a GEMM: fine for the tiny CPU models. Where Triton runs (a GPU)
the matmul, attention, RMSNorm and log-sum-exp are invariant_triton's fixed-configuration kernels instead (their own
fixed orders: both sides of a run take them), and RoPE, act(gate) * up (invariant_fused), residual adds and grouped
q/k/v or gate/up matmuls are fewer launches with the same bits.
Vision-language models (models/vision.py, qwen_vl.py): the tower's LayerNorm (`layer_norm`) and erf GELU
(`activation(x, "gelu")`) from tree sums and elementwise ops, its per-image attention through `attention`; the
decoder's M-RoPE positions are rotary positions only, the keys laid out by each token's place (`Aligned.of`).
LoRA projections multiply their merged weight W + s·BA (`merged_weight`, one fixed order): the engine computes it
once per call, the trainer's forward again from the same parameters, the backward is the default LoRA forward's.
The vocabulary head (the sampler's log-probs and the trainer's) is invariant_head.py. Not here: which mode runs
(`enable`/`enabled` hold it; the builder sets it from rollout.bitwise), where the decoder and the engine call these
(models/layers.py, attention.py, decoder.py; rollout/bitwise.py).

Legend: N rows (tokens), K matmul depth, H hidden, V vocab, n sequences (or slots), T queries, L key positions,
Hq/Hkv heads, D head_dim.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from phaserl.models import invariant_fused, invariant_triton

Tensor = torch.Tensor
KEY_BLOCK = 32                # attention: key positions per block (the engine's 64-token slots hold whole blocks)
CHUNK_ELEMENTS = 1 << 22      # products held at once by matmul / attention (16 MiB of float32) on the CPU
CUDA_CHUNK_ELEMENTS = 1 << 27  # on a GPU (512 MiB): fewer, larger launches. No chunk size changes any result:
                               # each output element is computed whole inside one chunk
_ENABLED = False


# ----- the mode -----------------------------------------------------------------------------------
def enabled() -> bool:
    """True while the bitwise kernels replace the default ones (decoder, engine, log-prob heads)."""
    return _ENABLED


def enable(on: bool) -> None:
    """Choose the kernels of this process: the builder calls it once per run from rollout.bitwise."""
    global _ENABLED
    _ENABLED = bool(on)


@contextmanager
def bitwise(on: bool = True):
    """The bitwise kernels (or not) inside the block; the previous choice after it (tests, benchmarks)."""
    before = _ENABLED
    enable(on)
    try:
        yield
    finally:
        enable(before)


# ----- the fixed-order reductions -----------------------------------------------------------------
def tree_sum(x: Tensor, dim: int = -1) -> Tensor:
    """Sum over `dim` as a pairwise tree whose shape depends only on that length: element i + element i + n/2
    first (an odd last element waits for the next level). Each add is elementwise, so exactly rounded."""
    x = x.movedim(dim, -1)
    while x.shape[-1] > 1:
        n = x.shape[-1]
        half = n // 2
        pairs = x[..., :half] + x[..., half:2 * half]
        x = pairs if n % 2 == 0 else torch.cat([pairs, x[..., 2 * half:]], dim=-1)
    return x[..., 0]


def _fold(blocks: Tensor) -> Tensor:
    """Left fold over dim -1 (blocks in order): ((b0 + b1) + b2) + ...; trailing zero blocks change nothing."""
    acc = blocks[..., 0]
    for i in range(1, blocks.shape[-1]):
        acc = acc + blocks[..., i]
    return acc


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk(device: torch.device) -> int:
    return CUDA_CHUNK_ELEMENTS if device.type == "cuda" else CHUNK_ELEMENTS


def matmul(x: Tensor, w: Tensor) -> Tensor:
    """x [N, K] @ w[N', K].T -> [N, N'] accumulated in float32 (float64 for float64), every output element the tree
    sum of its K products, whatever N. Chunked over rows and columns (each output element is computed alone)."""
    if invariant_triton.available(x.device) and x.dtype != torch.float64:  # the GPU's fixed-tile kernel
        return invariant_triton.matmul(x, w.to(x.dtype))
    acc = _acc_dtype(x.dtype)
    x, w = x.to(acc), w.to(acc)
    N, K = x.shape
    chunk = _chunk(x.device)
    cols = max(1, min(w.shape[0], chunk // K))
    rows = max(1, chunk // (cols * K))
    out = torch.empty(N, w.shape[0], dtype=acc, device=x.device)
    for c in range(0, w.shape[0], cols):
        wc = w[None, c:c + cols]  # [1, cols, K]
        for r in range(0, N, rows):
            out[r:r + rows, c:c + cols] = tree_sum(x[r:r + rows, None, :] * wc)
    return out


# ----- autograd: exact forward, the default kernel's backward --------------------------------------
class _Exact(torch.autograd.Function):
    """forward = exact(*tensors); backward = the gradient of default(*tensors) at the same inputs (recomputed)."""

    @staticmethod
    def forward(ctx, exact: Callable, default: Callable, *tensors):
        ctx.default = default
        ctx.save_for_backward(*tensors)
        return exact(*tensors)

    @staticmethod
    def backward(ctx, grad):
        inputs = [t.detach().requires_grad_(need) if t is not None else None
                  for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad[2:])]
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        with torch.enable_grad():
            out = ctx.default(*inputs)
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True)) if wanted else iter(())
        return (None, None, *[next(grads) if t is not None and t.requires_grad else None for t in inputs])


def _exact(exact: Callable, default: Callable, *tensors) -> Tensor:
    """exact(*tensors), differentiable with default's gradient; the plain call when nothing needs a gradient."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return _Exact.apply(exact, default, *tensors)
    return exact(*tensors)


# ----- the layer kernels (layers.py calls these in bitwise mode) ------------------------------------
class Projection(NamedTuple):
    """A frozen projection the engine multiplies: a LoRA projection's merged weight (`merged_weight`) and its bias."""
    weight: Tensor             # [out, in]
    bias: Optional[Tensor]     # [out]


def is_adapter(w) -> bool:
    """A LoRA projection (models/lora.LoRALinear, duck-typed: this module imports no model code)."""
    return isinstance(w, nn.Module) and isinstance(getattr(w, "lora_A", None), Tensor)


def _weights_of(w) -> tuple[Tensor, Optional[Tensor]]:
    if isinstance(w, (nn.Linear, Projection)):
        return w.weight, w.bias
    if isinstance(w, Tensor):
        return w, None
    raise TypeError(f"the bitwise kernels take plain projections (nn.Linear, a tensor) or phaserl's LoRA projections, "
                    f"not {type(w).__name__}: set rollout.bitwise = false")


def _linear_exact(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """x [..., K] @ weight [N, K].T rounded to x's dtype, then + bias [N]: the same bits for a row whatever N is."""
    rows = x.reshape(-1, x.shape[-1])  # [N, K]
    if invariant_triton.available(x.device) and x.dtype != torch.float64:  # one launch, the same rounding
        return invariant_triton.matmul(rows, weight.to(x.dtype), bias, x.dtype).view(*x.shape[:-1], -1)
    y = matmul(rows, weight).to(x.dtype).view(*x.shape[:-1], -1)
    return y if bias is None else y + bias


def _linear_residual_exact(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Tensor) -> Tensor:
    """residual + (x @ weight.T rounded, + bias) in the matmul's epilogue (invariant_triton.matmul): torch's adds."""
    rows = x.reshape(-1, x.shape[-1])  # [N, K]
    out = invariant_triton.matmul(rows, weight.to(x.dtype), bias, x.dtype, residual=residual.reshape(rows.shape[0], -1))
    return out.view(*x.shape[:-1], -1)


def _linear_residual_default(x: Tensor, weight: Tensor, bias: Optional[Tensor], residual: Tensor) -> Tensor:
    return residual + F.linear(x, weight, bias)


def linear(x: Tensor, w, bias: Optional[Tensor] = None, residual: Optional[Tensor] = None) -> Tensor:
    """layers.linear's contract, x [..., K] -> [..., N]: the matmul rounded to x's dtype, then + bias, then
    + residual (each add rounded on its own; where Triton runs, in the matmul's epilogue, the same bits). A LoRA
    projection multiplies its merged weight (`lora_linear`)."""
    if is_adapter(w):
        y = lora_linear(x, w, bias)
    else:
        weight, own_bias = _weights_of(w)
        bias = own_bias if bias is None else bias
        if residual is not None and _fused(x, residual) and residual.shape[-1] == weight.shape[0] and (
                residual.shape[:-1] == x.shape[:-1]):
            return _exact(_linear_residual_exact, _linear_residual_default, x, weight, bias, residual)
        y = _exact(_linear_exact, F.linear, x, weight, bias)
    return y if residual is None else residual + y


def linears(x: Tensor, ws) -> list[Tensor]:
    """[linear(x, w) for w in ws] (q/k/v, gate/up): one launch where Triton runs, no gradient is wanted and each is a
    plain one-split weight of x's dtype (invariant_triton.matmul_group: every output the bits of its own call)."""
    if _fused(x) and not any(is_adapter(w) for w in ws):
        weights, biases = zip(*[_weights_of(w) for w in ws])
        tensors = [x, *weights, *[b for b in biases if b is not None]]
        if (not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)) and len(
                {b is None for b in biases}) == 1 and _fused(x, *weights) and invariant_triton.groupable(
                x.shape[-1], weights):
            outs = invariant_triton.matmul_group(x.reshape(-1, x.shape[-1]), weights, biases, x.dtype)
            return [y.view(*x.shape[:-1], -1) for y in outs]
    return [linear(x, w) for w in ws]


def merged_weight(weight: Tensor, lora_A: Tensor, lora_B: Tensor, scaling: float) -> Tensor:
    """W + scaling · B A [out, in] in W's dtype: (scaling · B) [out, r] and A [r, in] in float32 (float64 for a
    float64 W), every element of their product a tree sum over r (`matmul`), plus W, rounded once. The engine
    multiplies this tensor (rollout/bitwise.engine_weights) and the trainer's forward computes it again from the
    same parameters: the same function of the same tensors, so the same bits."""
    acc = _acc_dtype(weight.dtype)
    delta = matmul(lora_B.to(acc) * scaling, lora_A.to(acc).T)  # [out, in]
    return (weight.to(acc) + delta).to(weight.dtype)


def lora_linear(x: Tensor, lora: nn.Module, bias: Optional[Tensor] = None) -> Tensor:
    """A LoRALinear's output x [..., in] -> [..., out] in bitwise mode: forward x @ merged_weight(...).T (+ bias),
    the engine's numbers; backward the default LoRA forward's gradient (x Wᵀ + b + (x Aᵀ) (s B)ᵀ), so A and B get
    the gradients the default kernels give them. An adapter switched off is its base projection."""
    bias = lora.bias if bias is None else bias
    if not lora.adapter_enabled:
        return _exact(_linear_exact, F.linear, x, lora.weight, bias)
    if lora.training and isinstance(lora.dropout, nn.Dropout):
        raise ValueError("LoRA dropout has no merged weight: set actor.lora.dropout = 0 (and critic.lora.dropout) "
                         "with rollout.bitwise = true")
    s = lora.scaling

    def exact(x, weight, bias, A, B):
        return _linear_exact(x, merged_weight(weight, A, B, s), bias)

    def default(x, weight, bias, A, B):
        return F.linear(x, weight, bias) + F.linear(F.linear(x, A.to(x.dtype)), (B * s).to(x.dtype))

    return _exact(exact, default, x, lora.weight, bias, lora.lora_A, lora.lora_B)


def rms_norm(x: Tensor, weight: Optional[Tensor], eps: float, style: str, default: Callable) -> Tensor:
    """layers.rms_norm with the mean square as a tree sum: x32 / sqrt(mean(x32^2) + eps), rounded where the style
    rounds (see layers.rms_norm). `default`: layers.rms_norm itself, whose gradient the backward takes (passed in,
    so that this module does not import the one that dispatches to it)."""

    def exact(x, weight):
        if invariant_triton.available(x.device) and x.dtype != torch.float64:
            return invariant_triton.rms_norm(x, weight, eps, style)
        x32 = x.to(_acc_dtype(x.dtype))
        mean_square = tree_sum(x32 * x32) / x.shape[-1]
        n = x32 / torch.sqrt(mean_square + eps)[..., None]
        if weight is None:
            return n.to(x.dtype)
        if style == "llama":
            return weight * n.to(x.dtype)
        if style == "gemma":
            return (n * (1.0 + weight.to(n.dtype))).to(x.dtype)
        return (weight * n).to(x.dtype)

    def default_fn(x, weight):
        with bitwise(False):
            return default(x, weight, eps, style)

    return _exact(exact, default_fn, x, weight)


def _rotate_torch(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    return x * cos[..., None, :] + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin[..., None, :]


def _fused(*tensors: Tensor) -> bool:
    """invariant_triton's elementwise kernels take these: Triton runs on their device, one 16/32-bit float dtype."""
    t = tensors[0]
    return invariant_triton.FUSED and invariant_triton.available(t.device) and t.dtype != torch.float64 and all(
        u.dtype == t.dtype for u in tensors)


def rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """RoPE as layers.rotate: x * cos + roll(x) * signed_sin, two products and a sum, each rounded alone
    (addcmul's fused multiply-add may round differently in its vectorized and scalar loops). Where Triton runs, one
    kernel with those roundings (invariant_fused.rotate: the same bits)."""
    if not _fused(x, cos, signed_sin):
        return _rotate_torch(x, cos, signed_sin)
    return _exact(lambda x: invariant_fused.rotate([x], cos, signed_sin)[0],
                  lambda x: _rotate_torch(x, cos, signed_sin), x)


def rotate_pair(q: Tensor, k: Tensor, cos: Tensor, signed_sin: Tensor) -> tuple[Tensor, Tensor]:
    """(rotate(q), rotate(k)) for q [..., Hq, D], k [..., Hkv, D] of the same leading dims: one launch where Triton
    runs and no gradient is wanted (the engine's decode and prefill, the trainer's scoring); the same bits either
    way."""
    if _fused(q, k, cos, signed_sin) and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)):
        q, k = invariant_fused.rotate([q, k], cos, signed_sin)
        return q, k
    return rotate(q, cos, signed_sin), rotate(k, cos, signed_sin)


GELU_C = (2.0 / torch.pi) ** 0.5


def activation(gate: Tensor, act: str) -> Tensor:
    """silu, gelu-tanh or (act "gelu", the vision mergers') erf gelu in float32 from exp / tanh / erf / division,
    rounded to gate's dtype (layers.activation)."""
    def exact(g):
        g32 = g.to(_acc_dtype(g.dtype))
        if act == "silu":
            return (g32 / (1.0 + torch.exp(-g32))).to(g.dtype)
        if act == "gelu":
            return (0.5 * g32 * (1.0 + torch.erf(g32 * SQRT_HALF))).to(g.dtype)
        inner = (g32 + 0.044715 * (g32 * g32 * g32)) * GELU_C
        return (0.5 * g32 * (1.0 + torch.tanh(inner))).to(g.dtype)

    def default(g):
        if act == "silu":
            return F.silu(g)
        return F.gelu(g) if act == "gelu" else F.gelu(g, approximate="tanh")

    return _exact(exact, default, gate)


SQRT_HALF = 0.5 ** 0.5


def gated(gate: Tensor, up: Tensor, act: str) -> Tensor:
    """The gated MLP's activation(gate, act) * up [..., I], act rounded to the dtype, then the product: one kernel
    where Triton runs (invariant_fused.gated, the same roundings), the torch ops elsewhere."""
    if not (_fused(gate, up) and act in invariant_fused.ACTS):
        return activation(gate, act) * up

    def default(g, u):
        return (F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")) * u

    return _exact(lambda g, u: invariant_fused.gated(g, u, act), default, gate, up)


def layer_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float) -> Tensor:
    """F.layer_norm over the last dim (the vision towers' LayerNorm), x [..., E] -> [..., E]: the mean and the
    variance as tree sums in float32, (x - mean) / sqrt(variance + eps) * weight + bias, rounded once to x's dtype."""

    def exact(x, weight, bias):
        acc = _acc_dtype(x.dtype)
        x32 = x.to(acc)
        centered = x32 - (tree_sum(x32) / x.shape[-1])[..., None]
        n = centered / torch.sqrt(tree_sum(centered * centered) / x.shape[-1] + eps)[..., None]
        n = n if weight is None else n * weight.to(acc)
        return (n if bias is None else n + bias.to(acc)).to(x.dtype)

    def default(x, weight, bias):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)

    return _exact(exact, default, x, weight, bias)


# ----- attention -----------------------------------------------------------------------------------
def _attention_exact(q: Tensor, qpos: Tensor, k: Tensor, v: Tensor, scale: float, window: Optional[int]) -> Tensor:
    """q [n, T, Hq, D] at positions qpos [n, T]; k/v [n, L, Hkv, D] at positions 0..L-1 -> [n, T, Hq, D]: a query
    sees keys at positions <= its own (and > its own - window); blocked sums as the module docstring says (on a
    GPU: invariant_triton's kernel, its own fixed order)."""
    if invariant_triton.available(q.device) and q.dtype != torch.float64:
        return invariant_triton.attention(q, qpos, k, v, scale, window)
    n, T, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    acc = _acc_dtype(q.dtype)
    pad = -L % KEY_BLOCK
    if pad:
        k, v = F.pad(k, (0, 0, 0, 0, 0, pad)), F.pad(v, (0, 0, 0, 0, 0, pad))
    heads = torch.arange(Hq, device=q.device) // (Hq // Hkv)
    k, v = k[:, :, heads].to(acc), v[:, :, heads].to(acc)  # [n, Lp, Hq, D] each key/value head per query head
    qs = q.to(acc) * scale
    key_pos = torch.arange(L + pad, device=q.device)  # [Lp]
    out = torch.empty(n, T, Hq, D, dtype=acc, device=q.device)
    per_query, chunk = (L + pad) * Hq * D, _chunk(q.device)  # products of one query
    if per_query * T <= chunk:  # whole rows of queries at a time
        rows, step = chunk // (per_query * T), T
    else:
        rows, step = 1, max(1, chunk // per_query)
    for a in range(0, n, rows):
        for t in range(0, T, step):
            qc, pc = qs[a:a + rows, t:t + step], qpos[a:a + rows, t:t + step]  # [r, s, Hq, D], [r, s]
            kc, vc = k[a:a + rows], v[a:a + rows]
            scores = tree_sum(qc[:, :, None] * kc[:, None])  # [r, s, Lp, Hq]
            seen = key_pos[None, None, :] <= pc[:, :, None]  # [r, s, Lp]
            if window is not None:
                seen = seen & (key_pos[None, None, :] > pc[:, :, None] - window)
            scores = scores.masked_fill(~seen[..., None], float("-inf"))
            top = scores.amax(dim=2, keepdim=True)  # [r, s, 1, Hq]
            top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
            p = torch.where(seen[..., None], torch.exp(scores - top), torch.zeros_like(scores))  # [r, s, Lp, Hq]
            blocks = p.unflatten(2, (-1, KEY_BLOCK))  # [r, s, nb, KB, Hq]
            total = _fold(tree_sum(blocks, dim=3).movedim(2, -1))  # [r, s, Hq]
            weighted = p[..., None] * vc[:, None]  # [r, s, Lp, Hq, D]
            mixed = tree_sum(weighted.unflatten(2, (-1, KEY_BLOCK)), dim=3)  # [r, s, nb, Hq, D]
            out[a:a + rows, t:t + step] = _fold(mixed.movedim(2, -1)) / total[..., None]
    return out.to(q.dtype)


def _attention_default(q: Tensor, qpos: Tensor, k: Tensor, v: Tensor, scale: float, window: Optional[int],
                       causal: bool = False) -> Tensor:
    """The same attention with torch's kernels (the backward of the exact one). causal: qpos is 0..T-1 in every
    row (the training layout), so without a window SDPA's causal kernel serves (no [T, L] mask)."""
    L, groups = k.shape[1], q.shape[2] // k.shape[2]
    if causal and window is None:
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [n, heads, T|L, D]
        kt, vt = kt.repeat_interleave(groups, dim=1), vt.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale).transpose(1, 2)
    key_pos = torch.arange(L, device=q.device)
    seen = key_pos[None, None, :] <= qpos[:, :, None]  # [n, T, L]
    if window is not None:
        seen = seen & (key_pos[None, None, :] > qpos[:, :, None] - window)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [n, heads, T|L, D]
    kt, vt = kt.repeat_interleave(groups, dim=1), vt.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=seen[:, None], scale=scale).transpose(1, 2)


def attention(q: Tensor, qpos: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None,
              window: Optional[int] = None, causal: bool = False) -> Tensor:
    """Queries q [n, T, Hq, D] at positions qpos [n, T] over their sequence's keys k/v [n, L, Hkv, D], key j at
    position j -> [n, T, Hq, D]. scale None: D ** -0.5. The engine's decode, prefill and extend passes and the
    trainer's forward (`Aligned`) all call this. causal: qpos is 0..T-1 in every row, T = L (the backward's
    shortcut)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _exact(lambda q, k, v: _attention_exact(q, qpos, k, v, scale, window),
                  lambda q, k, v: _attention_default(q, qpos, k, v, scale, window, causal), q, k, v)


def places(real: Tensor, seq: Tensor) -> Tensor:
    """Each token's place in its sequence: the real tokens of that sequence before it.  real [B, T] bool, seq [B, T]
    (sequence ids numbered in row-major order, each sequence one run) -> [B, T] long (padding: any)."""
    flat_real, flat_seq = real.reshape(-1).long(), seq.reshape(-1)  # [B * T]
    count = flat_real.cumsum(0)  # real tokens up to and including each
    first = torch.full((int(flat_seq.max()) + 1,), flat_seq.numel(), dtype=torch.long, device=seq.device)
    first = first.scatter_reduce(0, flat_seq, torch.arange(flat_seq.numel(), device=seq.device), "amin")  # [n]
    before = count[first] - flat_real[first]  # real tokens before each sequence's first token
    return (count - 1 - before[flat_seq]).view(real.shape)


@dataclass(frozen=True)
class Aligned:
    """The training forward's tokens laid out by (sequence, position) for `attention`: token (b, t) is sequence
    seq[b, t] at position pos[b, t] (real tokens only). The decoder builds one in bitwise mode instead of a mask
    or varlen boundaries; padded rows and packed rows alike."""
    seq: Tensor          # [B, T] long: the sequence of each token (0..n-1; padding: 0)
    pos: Tensor          # [B, T] long: its position in that sequence (padding: 0)
    real: Tensor         # [B, T] bool
    num_seqs: int
    length: int          # L: longest sequence
    window: Optional[int] = None

    @classmethod
    def of(cls, attention_mask: Tensor, position_ids: Tensor, seq_ids: Optional[Tensor],
           window: Optional[int] = None) -> "Aligned":
        """attention_mask [B, T] (1 = real), position_ids [B, T] (each sequence's real tokens at 0, 1, ...), seq_ids
        [B, T] or None (packed rows: runs of equal ids are sequences; None: one sequence per row). M-RoPE positions
        [3, B, T] (vision-language models) are rotary positions, not places in the sequence: each real token's place
        is then counted (`places`), where the engine writes its key."""
        B, T = attention_mask.shape
        real = attention_mask.bool()
        if seq_ids is None:
            seq = torch.arange(B, device=real.device)[:, None].expand(B, T)
        else:
            starts = torch.ones_like(seq_ids, dtype=torch.bool)
            starts[:, 1:] = seq_ids[:, 1:] != seq_ids[:, :-1]
            seq = starts.reshape(-1).long().cumsum(0).view(B, T) - 1  # a new row or id starts a sequence
        if position_ids.dim() == 3:
            position_ids = places(real, seq)
        pos = torch.where(real, position_ids.long(), torch.zeros_like(position_ids, dtype=torch.long))
        seq = torch.where(real, seq, torch.zeros_like(seq))
        return cls(seq, pos, real, int(seq.max()) + 1, int(pos.max()) + 1, window)

    def with_window(self, window: Optional[int]) -> "Aligned":
        return Aligned(self.seq, self.pos, self.real, self.num_seqs, self.length, window)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, scale: Optional[float]) -> Tensor:
        """q [B, T, Hq, D], k/v [B, T, Hkv, D] (the decoder's layout) -> [B, T, Hq, D] (padding tokens: 0)."""
        s, p, r = self.seq[self.real], self.pos[self.real], self.real  # [R] each
        shape = (self.num_seqs, self.length)

        def lay(x: Tensor) -> Tensor:  # [B, T, h, D] -> [n, L, h, D], real tokens at (seq, pos)
            return x.new_zeros(*shape, *x.shape[2:]).index_put((s, p), x[r])

        qpos = torch.arange(self.length, device=q.device).expand(shape)  # [n, L]
        out = attention(lay(q), qpos, lay(k), lay(v), scale, self.window, causal=True)  # [n, L, Hq, D]
        return q.new_zeros(q.shape).index_put((r.nonzero(as_tuple=True)), out[s, p])
