"""The bitwise mode's matmul and attention as Triton kernels with one fixed configuration (the GPU's fast path).

invariant.py's torch versions are exact by construction but memory-bound; on a GPU these two kernels replace them
(invariant.matmul and invariant.attention call them when `available`). What keeps them batch-invariant:
  matmul     one tile shape (BLOCK_M x BLOCK_N, K in BLOCK_K steps from 0, no split-K, no autotuning): an output
             element is its row's and column's dot product accumulated in the same order whatever the row count or
             the row's place in its tile (a tensor-core MMA computes each element alone);
  attention  one program per (sequence, block of BLOCK_Q queries, query head), key blocks of BLOCK_KEYS positions
             from position 0 in order, online softmax. A block past a query's position is an exact no-op for it
             (its weights are 0 and the running max does not move: the rescale is exp(0) = 1), so a decode step (one
             query, padded to BLOCK_Q rows) and the training forward (BLOCK_Q queries of a sequence) give a query
             the same bits. The engine's slots are read in place through strides.
Both sides of a run compute on the same device, so both take these kernels; the CPU keeps invariant.py's torch
versions (their bits differ from these, which no run compares). float32 inputs multiply in IEEE float32 (no TF32).
Not here: norms, activations, the log-softmax (invariant.py's elementwise ones are exact on any device).

Legend: N rows, M columns, K depth; n sequences (slots), T queries, L key positions, Hq/Hkv heads, D head_dim.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter: how the kernels are tested here
BLOCK_M, BLOCK_N, BLOCK_K, MATMUL_WARPS, MATMUL_STAGES = 64, 64, 32, 4, 3
BLOCK_Q, BLOCK_KEYS, ATTENTION_WARPS = 32, 32, 4


def available(device: torch.device) -> bool:
    """These kernels run on CUDA when Triton is installed (and on the CPU under TRITON_INTERPRET=1)."""
    return HAVE_TRITON and (device.type == "cuda" or INTERPRET)


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _matmul_kernel(x_ptr, w_ptr, out_ptr, N, M, K, x_sn, w_sm, o_sn, IEEE: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """out [N, M] float32 = x [N, K] @ w [M, K].T, one (BM, BN) tile per program, K from 0 in BK steps."""
        rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
        cols = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
        r_ok, c_ok = rows < N, cols < M
        acc = tl.zeros([BM, BN], tl.float32)
        for start in range(0, K, BK):
            ks = start + tl.arange(0, BK)
            k_ok = ks < K
            a = tl.load(x_ptr + rows[:, None] * x_sn + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptr + cols[None, :] * w_sm + ks[:, None], mask=c_ok[None, :] & k_ok[:, None], other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        tl.store(out_ptr + rows[:, None] * o_sn + cols[None, :], acc, mask=r_ok[:, None] & c_ok[None, :])

    @triton.jit
    def _attention_kernel(q_ptr, pos_ptr, k_ptr, v_ptr, out_ptr, T, L, scale, window,
                          q_sn, q_st, q_sh, p_sn, p_st, k_sn, k_sl, k_sh, v_sn, v_sl, v_sh, o_sn, o_st, o_sh,
                          GROUP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BQ: tl.constexpr,
                          BKEYS: tl.constexpr, WINDOW: tl.constexpr, IEEE: tl.constexpr):
        """Program (sequence, query block, query head): its queries over key positions 0.. in BKEYS blocks."""
        seq = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * BQ + tl.arange(0, BQ)
        head = tl.program_id(2)
        kv_head = head // GROUP
        d = tl.arange(0, BD)
        t_ok, d_ok = t < T, d < D
        qpos = tl.load(pos_ptr + seq * p_sn + t * p_st, mask=t_ok, other=-1)  # [BQ]; padding rows see nothing
        q = tl.load(q_ptr + seq * q_sn + t[:, None] * q_st + head * q_sh + d[None, :],
                    mask=t_ok[:, None] & d_ok[None, :], other=0.0)  # [BQ, BD]
        m = tl.full([BQ], float("-inf"), tl.float32)
        total = tl.zeros([BQ], tl.float32)
        acc = tl.zeros([BQ, BD], tl.float32)
        hi = tl.minimum(tl.max(qpos, axis=0) + 1, L)
        for start in range(0, hi, BKEYS):
            kpos = start + tl.arange(0, BKEYS)
            kd_ok = (kpos < L)[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + seq * k_sn + kpos[:, None] * k_sl + kv_head * k_sh + d[None, :], mask=kd_ok,
                        other=0.0)  # [BKEYS, BD]
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BQ, BKEYS]
            else:
                s = tl.dot(q, tl.trans(k)) * scale
            seen = kpos[None, :] <= qpos[:, None]
            if WINDOW:
                seen = seen & (kpos[None, :] > qpos[:, None] - window)
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: exp(-inf - 0) = 0
            alpha = tl.exp(m - base)
            p = tl.exp(s - base[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + seq * v_sn + kpos[:, None] * v_sl + kv_head * v_sh + d[None, :], mask=kd_ok,
                        other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out = acc / total[:, None]
        tl.store(out_ptr + seq * o_sn + t[:, None] * o_st + head * o_sh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=t_ok[:, None] & d_ok[None, :])


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, K] @ w [M, K].T -> [N, M] float32, batch-invariant (see the module docstring)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    N, K = x.shape
    M = w.shape[0]
    out = torch.empty(N, M, dtype=torch.float32, device=x.device)
    if N == 0 or M == 0:
        return out
    grid = (triton.cdiv(N, BLOCK_M), triton.cdiv(M, BLOCK_N))
    _matmul_kernel[grid](x, w, out, N, M, K, x.stride(0), w.stride(0), out.stride(0),
                         IEEE=x.dtype == torch.float32, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
                         num_warps=MATMUL_WARPS, num_stages=MATMUL_STAGES)
    return out


def attention(q: torch.Tensor, qpos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              window: Optional[int]) -> torch.Tensor:
    """invariant.attention's contract: q [n, T, Hq, D] at qpos [n, T]; k/v [n, L, Hkv, D] (any strides with the
    last dim contiguous: the engine's slots in place) -> [n, T, Hq, D] in q's dtype."""
    n, T, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    qpos = qpos.to(torch.int64)
    out = torch.empty(n, T, Hq, D, dtype=q.dtype, device=q.device)
    if n == 0 or T == 0:
        return out
    BD = max(16, triton.next_power_of_2(D))
    grid = (n, triton.cdiv(T, BLOCK_Q), Hq)
    _attention_kernel[grid](q, qpos, k, v, out, T, L, float(scale), int(window or 0),
                            q.stride(0), q.stride(1), q.stride(2), qpos.stride(0), qpos.stride(1),
                            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                            out.stride(0), out.stride(1), out.stride(2),
                            GROUP=Hq // Hkv, D=D, BD=BD, BQ=BLOCK_Q, BKEYS=BLOCK_KEYS, WINDOW=window is not None,
                            IEEE=q.dtype == torch.float32, num_warps=ATTENTION_WARPS)
    return out
