"""Triton kernels for the fused LM-head log-probs: one pass over each row of logits, forward and backward.

`token_logprobs_from_hidden(fused=True)` on a CUDA device with Triton installed uses them; elsewhere it
uses the torch.compile'd twins in logprobs.py (same math). Each program owns one row of a [n, V]
logits chunk (the LM head matmul's output, in its own dtype) and streams it once:

    row_stats   online softmax: running max m, s = sum exp(z - m), t = sum exp(z - m) * z, so that
                lse = m + log s, E_p[z] = t / s, entropy = lse - E_p[z], logp = z[target] - lse.
                Nothing [n, V] is written.
    row_grad_   overwrites the logits with d loss / d logits from (lse, E_p[z]) saved by row_stats:
                g_logp * (onehot - p) + g_ent * p * (E_p[z] - z), divided by the temperature.
                One read and one write of the chunk, no float32 copy.

The inductor-compiled versions read each chunk 2-3 times (a max pass, a sum pass, a second reduction
for the entropy) and recompute E_p[z] in backward; at Qwen2's V = 151,936 that memory traffic, not the
matmuls, was most of the head's time (BENCHMARKS.md, training step).
Legend: n = rows of the chunk, V = vocabulary size, z = logits / temperature (float32 in registers).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

BLOCK = 4096  # vocabulary entries per loop iteration of one program (8 warps x 32 lanes x 16)


def available(device: torch.device) -> bool:
    """True where these kernels run: a CUDA device with Triton installed (tests also run them on the CPU
    in Triton's interpreter, TRITON_INTERPRET=1)."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401  (a CUDA build of torch brings it)
    except ImportError:
        return False
    return True


_KERNELS: dict = {}  # "stats"/"grad" -> the jitted kernel, made on first use (after TRITON_INTERPRET is read)


def _kernels():
    if not _KERNELS:
        _KERNELS.update(zip(("stats", "grad"), _define()))
    return _KERNELS["stats"], _KERNELS["grad"]


def _define():
    import triton
    import triton.language as tl

    @triton.jit
    def stats_kernel(z_ptr, stride, target_ptr, inv_temp, logp_ptr, lse_ptr, mean_z_ptr, V: tl.constexpr,
                     BLOCK: tl.constexpr, WITH_ENT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        z_row = z_ptr + row * stride
        offs = tl.arange(0, BLOCK)
        m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)  # running max (a scalar)
        s = tl.zeros([BLOCK], tl.float32)  # per lane: sum of exp(z - m)
        t = tl.zeros([BLOCK], tl.float32)  # per lane: sum of exp(z - m) * z
        for start in range(0, V, BLOCK):
            cols = start + offs
            valid = cols < V
            z = tl.load(z_row + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
            m_new = tl.maximum(m, tl.max(z, 0))  # finite: every block has a valid column
            alpha = tl.exp(m - m_new)
            e = tl.exp(z - m_new)  # 0 where masked
            s = s * alpha + e
            if WITH_ENT:
                t = t * alpha + tl.where(valid, e * z, 0.0)
            m = m_new
        total = tl.sum(s, 0)
        lse = m + tl.log(total)
        target = tl.load(target_ptr + row)
        z_target = tl.load(z_row + target).to(tl.float32) * inv_temp
        tl.store(logp_ptr + row, z_target - lse)
        tl.store(lse_ptr + row, lse)
        if WITH_ENT:
            tl.store(mean_z_ptr + row, tl.sum(t, 0) / total)

    @triton.jit
    def grad_kernel(z_ptr, stride, target_ptr, inv_temp, lse_ptr, mean_z_ptr, g_logp_ptr, g_ent_ptr, V: tl.constexpr,
                    BLOCK: tl.constexpr, WITH_ENT: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        z_row = z_ptr + row * stride
        offs = tl.arange(0, BLOCK)
        lse = tl.load(lse_ptr + row)
        g_logp = tl.load(g_logp_ptr + row).to(tl.float32)
        target = tl.load(target_ptr + row)
        if WITH_ENT:
            mean_z = tl.load(mean_z_ptr + row)
            g_ent = tl.load(g_ent_ptr + row).to(tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + offs
            valid = cols < V
            raw = tl.load(z_row + cols, mask=valid, other=0.0)
            z = raw.to(tl.float32) * inv_temp
            p = tl.exp(z - lse)
            grad = tl.where(cols == target, g_logp, 0.0) - g_logp * p
            if WITH_ENT:
                grad += g_ent * p * (mean_z - z)
            tl.store(z_row + cols, (grad * inv_temp).to(raw.dtype), mask=valid)

    return stats_kernel, grad_kernel


def _check(logits: Tensor, targets: Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be a row-contiguous [n, V] tensor, got shape {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    if targets.shape != logits.shape[:1]:
        raise ValueError(f"targets must be [n] = [{logits.shape[0]}], got {tuple(targets.shape)}")


def row_stats(logits: Tensor, targets: Tensor, temperature: float,
              with_entropy: bool) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """(logp [n], lse [n], E_p[z] [n] or None), float32, of softmax(logits / temperature); one pass."""
    _check(logits, targets)
    n, V = logits.shape
    logp = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(logp)
    mean_z = torch.empty_like(logp) if with_entropy else lse  # unused pointer when not with_entropy
    if n:
        stats_kernel, _ = _kernels()
        stats_kernel[(n,)](logits, logits.stride(0), targets, 1.0 / temperature, logp, lse, mean_z, V,
                           BLOCK=BLOCK, WITH_ENT=with_entropy, num_warps=8)
    return logp, lse, (mean_z if with_entropy else None)


def row_grad_(logits: Tensor, targets: Tensor, lse: Tensor, mean_z: Optional[Tensor], g_logp: Tensor,
              g_ent: Optional[Tensor], temperature: float) -> Tensor:
    """Overwrite `logits` [n, V] with d loss / d logits (its own dtype) and return it.

    g_logp, g_ent: the upstream gradients of logp and entropy [n] (g_ent None: entropy unused, mean_z
    may then be None too)."""
    _check(logits, targets)
    n, V = logits.shape
    with_entropy = g_ent is not None
    if with_entropy and mean_z is None:
        raise ValueError("row_grad_: an entropy gradient needs the E_p[z] that row_stats(with_entropy=True) returns")
    if n:
        _, grad_kernel = _kernels()
        grad_kernel[(n,)](logits, logits.stride(0), targets, 1.0 / temperature, lse,
                          mean_z if with_entropy else lse, g_logp.contiguous(),
                          g_ent.contiguous() if with_entropy else g_logp, V,
                          BLOCK=BLOCK, WITH_ENT=with_entropy, num_warps=8)
    return logits
