"""A Triton kernel for the Gated DeltaNet decode step (Qwen3.5's linear-attention layers in the engine).

  delta_step_  one token per row: the state S [Hv, Dk, Dv] (float32) of each row is read once and written
               once: pred = S^T k, u = beta (v - e^g pred), S <- e^g S + k u^T, o = S^T q.
The torch version (models/linear_attention.recurrent_step_) reads the state four times and writes it twice;
at Qwen3.5-0.8B shapes the state is 19 MB per slot, so the decode step is bound by these passes.
Each program owns one (row, value head, block of Dv) tile of the state: Dk x BV floats in registers.
Runs inside CUDA graphs (no host sync); on the CPU only under TRITON_INTERPRET=1 (how it is tested here).
Not here: the conv step, the projections and norms around it (plain torch, models/linear_attention.py).

Legend: b rows, Hv value heads, Dk/Dv key/value head dims, BV the Dv block.
"""
from __future__ import annotations

import torch

from phaserl.rollout import kernels

DV_BLOCK, WARPS = 32, 4  # a first guess: one 128 x 32 float32 tile per program

if kernels.HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _delta_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, o_ptr, heads,
                           DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
        row, head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rh = row.to(tl.int64) * heads + head  # the (row, head) pair, flat
        kk = tl.arange(0, BK)
        vv = block * BV + tl.arange(0, BV)
        k_ok, v_ok = kk < DK, vv < DV
        k = tl.load(k_ptr + rh * DK + kk, mask=k_ok, other=0.0)  # [BK]
        q = tl.load(q_ptr + rh * DK + kk, mask=k_ok, other=0.0)
        v = tl.load(v_ptr + rh * DV + vv, mask=v_ok, other=0.0)  # [BV]
        decay = tl.exp(tl.load(g_ptr + rh))
        beta = tl.load(beta_ptr + rh)
        tile = rh * DK * DV + kk[:, None] * DV + vv[None, :]  # [BK, BV] offsets into the state
        ok = k_ok[:, None] & v_ok[None, :]
        s = tl.load(state_ptr + tile, mask=ok, other=0.0)  # [BK, BV]
        pred = tl.sum(s * k[:, None], axis=0)  # [BV]: k^T S
        u = beta * (v - decay * pred)
        s = decay * s + k[:, None] * u[None, :]
        tl.store(state_ptr + tile, s, mask=ok)
        tl.store(o_ptr + rh * DV + vv, tl.sum(s * q[:, None], axis=0), mask=v_ok)


def delta_step_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor) -> torch.Tensor:
    """Same contract as models.linear_attention.recurrent_step_: q, k [b, Hv, Dk], v [b, Hv, Dv], g, beta [b, Hv]
    (float32), state [b, Hv, Dk, Dv] float32 contiguous, updated in place -> o [b, Hv, Dv] float32."""
    b, H, Dk, Dv = state.shape
    assert state.dtype == torch.float32 and state.is_contiguous()
    q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
    o = torch.empty(b, H, Dv, dtype=torch.float32, device=state.device)
    block = min(DV_BLOCK, triton.next_power_of_2(Dv))
    _delta_step_kernel[(b, H, triton.cdiv(Dv, block))](q, k, v, g, beta, state, o, H, DK=Dk, DV=Dv,
                                                      BK=triton.next_power_of_2(Dk), BV=block, num_warps=WARPS)
    return o
