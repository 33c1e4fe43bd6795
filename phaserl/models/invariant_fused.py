"""The bitwise mode's elementwise launches on the GPU: what invariant.py does in several torch ops, one Triton launch
each, with the bits of those ops (invariant_triton.FUSED turns them on; tests/test_invariant_fused.py).

  rotate     RoPE of the queries and keys in one launch: x * cos + roll(x, D/2) * signed_sin, each product and the
             sum rounded as invariant.rotate's torch ops round them (no fused multiply-adds): the same bits.
  gated      act(gate) * up in one launch: the activation in float32 through CUDA's libdevice exp/tanh (torch's own on
             the GPU), rounded, then the product rounded, as invariant.gated's torch ops.
  write_kv   the decode step's new keys and values into their slots, one launch for both (copies).
Elementwise, so invariant by nature: any block or grid gives the same bits.

Legend: N rows, D head_dim, I the MLP's width.
"""
from __future__ import annotations

from typing import Sequence

import torch

from phaserl.models import invariant_triton
from phaserl.models.invariant_triton import HAVE_TRITON, INTERPRET, available

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def _rope_heads(x_ptr, o_ptr, row, heads, x_sn, x_sh, o_sn, o_sh, c, s, d, rolled, d_ok, BH: tl.constexpr):
        """One row's heads [BH, D] of x: x * cos + roll(x, D/2) * signed_sin, each product and the sum rounded to
        x's dtype (invariant.rotate's three torch ops)."""
        h = tl.arange(0, BH)
        ok = (h < heads)[:, None] & d_ok[None, :]
        base = x_ptr + row * x_sn + h[:, None] * x_sh
        x = tl.load(base + d[None, :], mask=ok, other=0.0)
        xr = tl.load(base + rolled[None, :], mask=ok, other=0.0)
        dtype = x.dtype
        a = (x.to(tl.float32) * c[None, :]).to(dtype)
        b = (xr.to(tl.float32) * s[None, :]).to(dtype)
        out = (a.to(tl.float32) + b.to(tl.float32)).to(dtype)
        tl.store(o_ptr + row * o_sn + h[:, None] * o_sh + d[None, :], out, mask=ok)

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, hq, hk, q_sn, q_sh, k_sn, k_sh, c_sn, s_sn,
                     qo_sn, qo_sh, ko_sn, ko_sh, D: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr):
        """Program (row, 0) rotates the row's query heads, (row, 1) its key heads, with the row's tables [D]."""
        row = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BD)
        d_ok = d < D
        rolled = (d + (D - D // 2)) % D  # torch.roll(x, D // 2)[d] = x[(d - D // 2) mod D]
        c = tl.load(cos_ptr + row * c_sn + d, mask=d_ok, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + row * s_sn + d, mask=d_ok, other=0.0).to(tl.float32)
        if tl.program_id(1) == 0:
            _rope_heads(q_ptr, qo_ptr, row, hq, q_sn, q_sh, qo_sn, qo_sh, c, s, d, rolled, d_ok, BH)
        else:
            _rope_heads(k_ptr, ko_ptr, row, hk, k_sn, k_sh, ko_sn, ko_sh, c, s, d, rolled, d_ok, BH)

    @triton.jit
    def _gated_kernel(g_ptr, u_ptr, out_ptr, width, g_sn, u_sn, o_sn, ACT: tl.constexpr, ACCURATE: tl.constexpr,
                      BLOCK: tl.constexpr):
        """act(gate) * up as invariant.gated's torch ops round it: act in float32 rounded to the dtype, then the
        product rounded. ACT 0 silu g / (1 + exp(-g)); 1 tanh gelu 0.5 g (1 + tanh((g + 0.044715 g^3) C)).
        ACCURATE: CUDA's libdevice exp / tanh (torch's own functions on the GPU); the interpreter has none (tl.exp)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        gate = tl.load(g_ptr + row * g_sn + cols, mask=ok, other=0.0)
        dtype = gate.dtype
        g = gate.to(tl.float32)
        up = tl.load(u_ptr + row * u_sn + cols, mask=ok, other=0.0).to(tl.float32)
        if ACT == 0:
            e = libdevice.exp(-g) if ACCURATE else tl.exp(-g)
            act = tl.div_rn(g, 1.0 + e)
        else:
            inner = (g + 0.044715 * (g * g * g)) * 0.7978845608028654
            if ACCURATE:
                t = libdevice.tanh(inner)
            else:
                t = 1.0 - tl.div_rn(2.0, tl.exp(2.0 * inner) + 1.0)
            act = 0.5 * g * (1.0 + t)
        tl.store(out_ptr + row * o_sn + cols, (act.to(dtype).to(tl.float32) * up).to(dtype), mask=ok)


    @triton.jit
    def _write_kv_kernel(k_ptr, v_ptr, keys_ptr, values_ptr, pos_ptr, heads, k_sb, k_sh, v_sb, v_sh, c_ss, c_sh,
                         c_sp, e_ss, e_sh, e_sp, D: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):
        """Row r's new key and value [heads, D] into slot r at position pos[r] (copies: the bits unchanged)."""
        row = tl.program_id(0).to(tl.int64)
        p = tl.load(pos_ptr + row).to(tl.int64)
        h, d = tl.arange(0, BH), tl.arange(0, BD)
        ok = (h < heads)[:, None] & (d < D)[None, :]
        key = tl.load(k_ptr + row * k_sb + h[:, None] * k_sh + d[None, :], mask=ok)
        tl.store(keys_ptr + row * c_ss + h[:, None] * c_sh + p * c_sp + d[None, :], key, mask=ok)
        value = tl.load(v_ptr + row * v_sb + h[:, None] * v_sh + d[None, :], mask=ok)
        tl.store(values_ptr + row * e_ss + h[:, None] * e_sh + p * e_sp + d[None, :], value, mask=ok)


NO_FMA = dict(enable_fp_fusion=False)  # elementwise kernels: a product and a sum stay two roundings, as torch's
GATED_BLOCK = 1024
ACTS = {"silu": 0, "gelu_pytorch_tanh": 1}


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [..., width] as rows [N, width] with a unit last stride (a view where one exists)."""
    x = x.reshape(-1, width)
    return x if x.stride(-1) == 1 else x.contiguous()


def rotate(xs: Sequence[torch.Tensor], cos: torch.Tensor, signed_sin: torch.Tensor) -> list[torch.Tensor]:
    """invariant.rotate of one or two tensors x [..., heads, D] (queries and keys, the same leading dims) with tables
    [..., D] broadcast over them, in one launch; the same dtype throughout (the caller checks)."""
    lead, D = xs[0].shape[:-2], xs[0].shape[-1]
    heads = [x.shape[-2] for x in xs]
    rows = [x.reshape(-1, h, D) for x, h in zip(xs, heads)]  # [N, h, D], views where the leading dims merge
    rows = [r if r.stride(-1) == 1 else r.contiguous() for r in rows]
    c, s = (_rows(t.expand(*lead, D), D) for t in (cos, signed_sin))  # [N, D]
    outs = [torch.empty(r.shape, dtype=r.dtype, device=r.device) for r in rows]
    N = rows[0].shape[0]
    if N:
        q, k = rows[0], rows[-1]
        qo, ko = outs[0], outs[-1]
        _rope_kernel[(N, len(xs))](q, k, c, s, qo, ko, heads[0], heads[-1], q.stride(0), q.stride(1), k.stride(0),
                                   k.stride(1), c.stride(0), s.stride(0), qo.stride(0), qo.stride(1), ko.stride(0),
                                   ko.stride(1), D=D, BD=triton.next_power_of_2(D),
                                   BH=triton.next_power_of_2(max(heads)), num_warps=4, **NO_FMA)
    return [o.view(x.shape) for o, x in zip(outs, xs)]


def gated(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """invariant.gated's numbers, gate/up [..., I] of one dtype -> [..., I], one launch (act: ACTS)."""
    width = gate.shape[-1]
    g, u = _rows(gate, width), _rows(up, width)
    out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    if g.shape[0]:
        block = min(GATED_BLOCK, triton.next_power_of_2(width))
        _gated_kernel[(g.shape[0], triton.cdiv(width, block))](
            g, u, out, width, g.stride(0), u.stride(0), out.stride(0), ACT=ACTS[act], ACCURATE=not INTERPRET,
            BLOCK=block, num_warps=4, **NO_FMA)
    return out.view(gate.shape)


def write_kv(k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor) -> None:
    """The decode step's `keys[r, :, pos[r]] = k[r]` and the same for values, rows r < b, in one launch where these
    kernels run (two index_put launches and an arange elsewhere): k/v [b, Hkv, D], keys/values [slots, Hkv, S, D],
    pos [b]."""
    b, heads, D = k.shape
    if not (invariant_triton.FUSED and available(k.device)) or b == 0 or keys.stride(-1) != 1 or (
            values.stride(-1) != 1 or (keys.dtype, values.dtype) != (k.dtype, v.dtype)):
        rows = torch.arange(b, device=k.device)
        keys[rows, :, pos] = k
        values[rows, :, pos] = v
        return
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    pos = pos if pos.is_contiguous() else pos.contiguous()
    _write_kv_kernel[(b,)](k, v, keys, values, pos, heads, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           *keys.stride()[:3], *values.stride()[:3], D=D, BH=triton.next_power_of_2(heads),
                           BD=triton.next_power_of_2(D), num_warps=1)
