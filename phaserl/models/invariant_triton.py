"""The bitwise mode's matmul, attention, RMSNorm and log-sum-exp as Triton kernels of fixed configurations.

invariant.py's torch versions are exact by construction but memory-bound; on a GPU these kernels replace them
(invariant.matmul, .attention, .rms_norm and .logsumexp call them when `available`). What keeps them batch-invariant:
  matmul     invariant_tiles' tiles (no autotuning): an output element is its row's and column's dot product
             accumulated in the same order whatever the row count or the row's place in its tile (a tensor-core MMA
             computes each element alone); a call of few rows takes a tile of its own only where that tile's sums
             are BASE's on this GPU (agrees: checked once, else BASE everywhere), and runs BASE where its launch
             does not fit the GPU's shared memory (_fitting: the same bits). Split-K: a deep weight's depth is
             cut into S splits of KS, both a function of the weight's shape (k_splits(K, M)) and never of the row
             count (any other weight takes one split); each split accumulates its range in K steps from its own
             start, and the partials are added in split order, 0 + p0 + p1 + ..., in float32. Whether one program
             per tile adds its splits itself (many rows) or the splits run as programs of their own into a float32
             workspace that a second kernel adds in that order (few rows: decode) changes the speed, not the bits;
  attention  one program per (sequence, block of BLOCK_Q queries, query head), key blocks of BLOCK_KEYS positions
             from position 0 in order, online softmax. A block past a query's position is an exact no-op for it
             (its weights are 0 and the running max does not move: the rescale is exp(0) = 1), so a decode step (one
             query, padded to BLOCK_Q rows) and the training forward (BLOCK_Q queries of a sequence) give a query
             the same bits. The engine's slots are read in place through strides. At decode the grid is
             n x 1 x Hq programs, each with one real query of its BLOCK_Q rows walking its key blocks alone: no
             split over keys, which the training forward would have to share (chunks fixed by position, combined
             in order) to keep the bits.
Both sides of a run compute on the same device, so both take these kernels; the CPU keeps invariant.py's torch
versions (their bits differ from these, which no run compares). float32 inputs multiply in IEEE float32 (no TF32).
  rms_norm, logsumexp  one program per row, a fixed reduction over the row (fewer launches than invariant.py's
             elementwise trees, which are exact on any device too).
  residual   the matmul's epilogue adds a residual after its rounding (o and down projections): torch's add's bits.
  matmul_group  two or three one-split weights (q/k/v, gate/up) in one launch, each tile computed as its own call's.
RoPE, act(gate) * up and the KV write are invariant_fused.py's launches.

Legend: N rows, M columns, K depth; n sequences (slots), T queries, L key positions, Hq/Hkv heads, D head_dim.
"""
from __future__ import annotations

import importlib.util
import os
import warnings
from typing import Optional, Sequence

import torch

from phaserl.models.invariant_tiles import BASE, Tile, candidate

HAVE_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter: how the kernels are tested here
BLOCK_N, BLOCK_K = BASE.block_n, BASE.block_k  # the split-K layout's units (k_splits): the weight's, any tile
# Split-K: only deep weights split, K >= DEEP_RATIO x M and K >= DEEP_MIN_K: the down projections (K 3.5-5.8 M, 4864
# and more at the native families' sizes), no q/k/v/o/gate/up or vocabulary head. A deep weight's few column tiles
# leave the GPU idle at few rows (0.5B down at 32 rows: 10 splits 0.0148 ms against 0.0226 unsplit); a shallow or
# short one pays more for the workspace and the second launch than its splits gain. End to end: the 0.5B bitwise
# decode step 2.29 ms with this rule, 2.67 with every weight split, 2.61 split for 264 programs (H200, 2026-12-06,
# commit 3556c5c, benchmarks/numerics.py; a split q/k/v or gate/up also loses its group launch). docs/numerics.md
# has the per-call timings at 1-16384 rows.
# Fewer launches per layer, the same bits (tests/test_invariant_fused.py, in Triton's interpreter and on an H100; the
# 0.5B decode step 3.94 -> 2.27 ms, H100, 2026-12-06, benchmarks/numerics.py; BENCHMARKS.md):
GROUP = True            # q/k/v and gate/up in one launch (matmul_group) where no gradient is wanted; False: a call each
FUSED = True            # RoPE, act(gate) * up, residual adds and KV writes in one launch each; False: torch's ops
SPLIT_K = True          # False: one split for every weight (the matmul's bits before split-K; benchmarks time it)
DEEP_RATIO = 2          # a weight [M, K] splits its depth only when K >= DEEP_RATIO * M ...
DEEP_MIN_K = 4096       # ... and K >= DEEP_MIN_K (128 BLOCK_K steps)
FILL_PROGRAMS = 132     # the grid split-K aims at for few rows: one program per SM of a 132-SM GPU
MIN_SPLIT_STEPS = 4     # BLOCK_K steps a split covers at least: its loads still pipeline, the workspace stays small
SUM_ROWS, SUM_COLS = 8, 64  # _sum_splits_kernel's block (elementwise: any block gives the same bits; 32 x 128
# left 7 programs for a 0.5B down projection's 32 x 896 at decode: 13.5 us against 10.7, H100, 2026-12-06)
BLOCK_Q, BLOCK_KEYS, ATTENTION_WARPS = 32, 32, 4
WIDE_HEAD, WIDE_BLOCK = 256, 16  # heads wider than this (Gemma 4's 512) take 16 x 16 blocks: the tiles fit on chip


def attention_blocks(head_dim: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_KEYS) for a head width: a function of the layer alone, so every pass over it (decode,
    prefill, extend, training) takes the same blocks."""
    return (BLOCK_Q, BLOCK_KEYS) if head_dim <= WIDE_HEAD else (WIDE_BLOCK, WIDE_BLOCK)


def available(device: torch.device) -> bool:
    """These kernels run on CUDA when Triton is installed (and on the CPU under TRITON_INTERPRET=1)."""
    return HAVE_TRITON and (device.type == "cuda" or INTERPRET)


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, x_sn, o_sn, eps, H: tl.constexpr, BLOCK: tl.constexpr,
                         STYLE: tl.constexpr, HAS_WEIGHT: tl.constexpr):
        """One row: x32 / sqrt(mean(x32^2) + eps), rounded where invariant.rms_norm's style rounds
        (0 llama: w * round(norm); 1 gemma: round(norm * (1 + w)); 2 olmo2: round(w * norm))."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < H
        x = tl.load(x_ptr + row * x_sn + cols, mask=ok, other=0.0)
        dtype = x.dtype
        x32 = x.to(tl.float32)
        norm = x32 / tl.sqrt_rn(tl.sum(x32 * x32, axis=0) / H + eps)
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=ok, other=0.0)
            if STYLE == 0:  # the product in float32, rounded once (torch's half-precision multiply)
                out = (w.to(tl.float32) * norm.to(dtype).to(tl.float32)).to(out_ptr.dtype.element_ty)
            elif STYLE == 1:
                out = (norm * (1.0 + w.to(tl.float32))).to(dtype)
            else:
                out = (w.to(tl.float32) * norm).to(dtype)
        else:
            out = norm.to(dtype)
        tl.store(out_ptr + row * o_sn + cols, out.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _logsumexp_kernel(z_ptr, out_ptr, z_sn, V, BLOCK: tl.constexpr, STAGES: tl.constexpr):
        """One row of z [N, V] float32: its max, then exp(z - max) summed lane-wise over BLOCK-wide chunks in order
        and the lanes summed once: log of that + max. STAGES chunks' loads in flight (the order stays)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        top = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in tl.range(0, V, BLOCK, num_stages=STAGES):
            top = tl.maximum(top, tl.load(z_ptr + row * z_sn + start + cols, mask=start + cols < V,
                                          other=float("-inf")))
        m = tl.max(top, axis=0)
        m = tl.where(m == float("-inf"), 0.0, m)
        acc = tl.zeros([BLOCK], tl.float32)
        for start in tl.range(0, V, BLOCK, num_stages=STAGES):
            z = tl.load(z_ptr + row * z_sn + start + cols, mask=start + cols < V, other=float("-inf"))
            acc += tl.exp(z - m)
        tl.store(out_ptr + row, tl.log(tl.sum(acc, axis=0)) + m)


    @triton.jit
    def _split_dot(x_ptr, w_ptr, rows, cols, r_ok, c_ok, lo, hi, x_sn, w_sm, IEEE: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr):
        """One split's partial [BM, BN] float32: x[rows, lo:hi] @ w[cols, lo:hi].T, BK steps from lo in order."""
        acc = tl.zeros([BM, BN], tl.float32)
        for start in range(lo, hi, BK):
            ks = start + tl.arange(0, BK)
            k_ok = ks < hi
            a = tl.load(x_ptr + rows[:, None] * x_sn + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptr + cols[None, :] * w_sm + ks[:, None], mask=c_ok[None, :] & k_ok[:, None], other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _finish(total, b_ptr, r_ptr, out_ptr, rows, cols, r_ok, c_ok, o_sn, r_sn, HAS_BIAS: tl.constexpr,
                HAS_RES: tl.constexpr):
        """The epilogue both launches share: total [BM, BN] float32 rounded to out's dtype; a bias added after that
        rounding (rounded again); then a residual of out's dtype (rounded again: torch's `residual + y`)."""
        out = total.to(out_ptr.dtype.element_ty)
        ok = r_ok[:, None] & c_ok[None, :]
        if HAS_BIAS:
            b = tl.load(b_ptr + cols, mask=c_ok, other=0.0)
            out = (out.to(tl.float32) + b.to(tl.float32)[None, :]).to(out_ptr.dtype.element_ty)
        if HAS_RES:
            res = tl.load(r_ptr + rows[:, None] * r_sn + cols[None, :], mask=ok, other=0.0)
            out = (res.to(tl.float32) + out.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None] * o_sn + cols[None, :], out, mask=ok)

    @triton.jit(do_not_specialize=["N"])
    def _matmul_kernel(x_ptr, w_ptr, b_ptr, r_ptr, out_ptr, N, M, K, KS, S, x_sn, w_sm, o_sn, r_sn,
                       IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, PARTIAL: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """out [N, M] = x [N, K] @ w [M, K].T with K in S splits of KS (the last may be shorter).
        PARTIAL: program (i, j, s) writes split s's partial of tile (i, j) to out = the workspace [S, N, M] float32;
        else program (i, j, 0) adds its tile's S partials in split order (0 + p0 + p1 + ..., as _sum_splits_kernel
        does) and finishes the tile."""
        rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
        cols = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
        r_ok, c_ok = rows < N, cols < M
        if PARTIAL:
            s = tl.program_id(2)  # the K loop's bounds as the other launch computes them (int32)
            part = _split_dot(x_ptr, w_ptr, rows, cols, r_ok, c_ok, s * KS, tl.minimum(s * KS + KS, K), x_sn, w_sm,
                              IEEE, BM, BN, BK)
            tl.store(out_ptr + (s.to(tl.int64) * N + rows[:, None]) * M + cols[None, :], part,
                     mask=r_ok[:, None] & c_ok[None, :])
        else:
            total = tl.zeros([BM, BN], tl.float32)
            for s in range(0, S):
                total += _split_dot(x_ptr, w_ptr, rows, cols, r_ok, c_ok, s * KS, tl.minimum(s * KS + KS, K), x_sn,
                                    w_sm, IEEE, BM, BN, BK)
            _finish(total, b_ptr, r_ptr, out_ptr, rows, cols, r_ok, c_ok, o_sn, r_sn, HAS_BIAS, HAS_RES)

    @triton.jit
    def _group_tile(x_ptr, w_ptr, b_ptr, out_ptr, rows, col_tile, N, M, K, x_sn, w_sm, o_sn, IEEE: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """One weight's tile as _matmul_kernel's one-split program computes it (0 + the split's sum, finished)."""
        cols = col_tile.to(tl.int64) * BN + tl.arange(0, BN)
        r_ok, c_ok = rows < N, cols < M
        total = tl.zeros([BM, BN], tl.float32)
        total += _split_dot(x_ptr, w_ptr, rows, cols, r_ok, c_ok, 0, K, x_sn, w_sm, IEEE, BM, BN, BK)
        _finish(total, b_ptr, out_ptr, out_ptr, rows, cols, r_ok, c_ok, o_sn, 0, HAS_BIAS, False)

    @triton.jit(do_not_specialize=["N"])
    def _group_kernel(x_ptr, w0, w1, w2, b0, b1, b2, o0, o1, o2, N, M0, M1, M2, T0, T1, K, x_sn, s0, s1, s2, os0,
                      os1, os2, IEEE: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr):
        """x [N, K] times two or three one-split weights in one launch: column tiles 0..T0-1 are w0's, the next T1
        w1's, the rest w2's; each tile computed as a call with that weight alone computes it."""
        rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
        j = tl.program_id(1)
        if j < T0:
            _group_tile(x_ptr, w0, b0, o0, rows, j, N, M0, K, x_sn, s0, os0, IEEE, HAS_BIAS, BM, BN, BK)
        elif j < T0 + T1:
            _group_tile(x_ptr, w1, b1, o1, rows, j - T0, N, M1, K, x_sn, s1, os1, IEEE, HAS_BIAS, BM, BN, BK)
        else:
            _group_tile(x_ptr, w2, b2, o2, rows, j - T0 - T1, N, M2, K, x_sn, s2, os2, IEEE, HAS_BIAS, BM, BN, BK)

    @triton.jit(do_not_specialize=["N"])
    def _sum_splits_kernel(ws_ptr, b_ptr, r_ptr, out_ptr, N, M, o_sn, r_sn, S: tl.constexpr, HAS_BIAS: tl.constexpr,
                           HAS_RES: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        """out [N, M] = the workspace [S, N, M]'s partials added in split order (0 + p0 + p1 + ...), finished. S is a
        constant of the weight's shape: the loop unrolls, so the S loads are in flight together (the adds keep their
        order)."""
        rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
        cols = tl.program_id(1).to(tl.int64) * BC + tl.arange(0, BC)
        r_ok, c_ok = rows < N, cols < M
        total = tl.zeros([BR, BC], tl.float32)
        for s in tl.static_range(S):
            total += tl.load(ws_ptr + (s * N + rows[:, None]) * M + cols[None, :], mask=r_ok[:, None] & c_ok[None, :],
                             other=0.0)
        _finish(total, b_ptr, r_ptr, out_ptr, rows, cols, r_ok, c_ok, o_sn, r_sn, HAS_BIAS, HAS_RES)

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


STYLES = {"llama": 0, "gemma": 1, "olmo2": 2}
# The log-sum-exp's chunk, loads in flight and warps: one row of a 151,936-word vocabulary 65 us -> 30 with three
# 4096-wide chunks in flight and 8 warps (32 rows; 256 rows 163 -> 104; H100, 2026-12-06)
LSE_BLOCK, LSE_STAGES, LSE_WARPS = 4096, 3, 8


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, style: str) -> torch.Tensor:
    """invariant.rms_norm's numbers' contract on any rows x [..., H] (a program per row: invariant)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out_dtype = x.dtype if weight is None or style != "llama" else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if x2.shape[0]:
        H = shape[-1]
        _rms_norm_kernel[(x2.shape[0],)](x2, x2 if weight is None else weight, out, x2.stride(0), out.stride(0),
                                         float(eps), H=H, BLOCK=triton.next_power_of_2(H), STYLE=STYLES.get(style, 2),
                                         HAS_WEIGHT=weight is not None)
    return out.view(shape)


def logsumexp(z: torch.Tensor) -> torch.Tensor:
    """z [..., V] float32 -> [...]: a program per row, a fixed order over the vocabulary."""
    shape = z.shape
    z2 = z.reshape(-1, shape[-1]).float()
    z2 = z2 if z2.stride(-1) == 1 else z2.contiguous()
    out = torch.empty(z2.shape[0], dtype=torch.float32, device=z.device)
    if z2.shape[0]:
        _logsumexp_kernel[(z2.shape[0],)](z2, out, z2.stride(0), shape[-1], BLOCK=LSE_BLOCK, STAGES=LSE_STAGES,
                                          num_warps=LSE_WARPS)
    return out.view(shape[:-1])


def k_splits(K: int, M: int) -> tuple[int, int]:
    """(S, KS): the matmul with a weight [M, K] sums its depth in S splits of KS (a multiple of BLOCK_K; the last may
    be shorter). A function of the weight's shape alone, never of the row count, so every call with that weight adds
    the same partials in the same order. Only a deep weight (K >= DEEP_RATIO * M and K >= DEEP_MIN_K) splits: S aims
    the row-count-1 grid, cdiv(M, BLOCK_N) x S programs, at FILL_PROGRAMS, with at least MIN_SPLIT_STEPS BLOCK_K steps
    a split. Any other weight, or SPLIT_K = False, takes one split."""
    steps = max(1, _cdiv(K, BLOCK_K))
    deep = SPLIT_K and K >= DEEP_RATIO * M and K >= DEEP_MIN_K
    want = _cdiv(FILL_PROGRAMS, _cdiv(max(M, 1), BLOCK_N)) if deep else 1
    splits = max(1, min(want, steps // MIN_SPLIT_STEPS))
    per = _cdiv(steps, splits)  # BLOCK_K steps a split
    return _cdiv(steps, per), per * BLOCK_K


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


LAUNCHES = ("auto", "splits", "tiles")
_AGREES: dict = {}  # (tile, device, dtype) -> whether its float32 sums are BASE's (agrees)
CHECK_ROWS, CHECK_COLS, CHECK_DEPTHS = 40, 80, (1008, 4112)  # agrees()'s problem: ragged rows, one split / 26


_TOO_BIG: set = set()  # (kernel, tile, device, dtype) whose launch needs more shared memory than this GPU has


def tile_for(rows: int, cols: int, device: torch.device, dtype: torch.dtype, splits: int = 1,
             kernel: str = "matmul") -> Tile:
    """The tile a call of `rows` rows, `cols` output columns (a group launch: its weights' total) and `splits` K
    splits takes: invariant_tiles.candidate's where it agrees with BASE on this device and dtype and its `kernel`'s
    launch fits the GPU's shared memory (_fitting), else BASE."""
    tile = candidate(rows, cols, splits)
    if tile == BASE or (kernel, tile, device, dtype) in _TOO_BIG:
        return BASE
    return tile if agrees(tile, device, dtype) else BASE


def _fitting(launch, kernel: str, tile: Tile, chosen: bool, device: torch.device, dtype: torch.dtype):
    """launch(tile)'s result; where the tile was tile_for's choice (`chosen`) and its compiled kernel needs more shared
    memory than this GPU has (a float32 group launch on an H100: 288 KiB of 227), launch(BASE) instead: the same
    bits (agrees), BASE's speed, remembered for the process (tile_for skips the tile for that kernel)."""
    try:
        return launch(tile)
    except triton.runtime.errors.OutOfResources as error:
        if not chosen or tile == BASE:
            raise
        _TOO_BIG.add((kernel, tile, device, dtype))
        warnings.warn(f"bitwise mode: the {kernel} kernel's {tile} launch does not fit this GPU ({error}); those calls "
                      f"take {BASE} (slower, the same bits)", RuntimeWarning, stacklevel=3)
        return launch(BASE)


def agrees(tile: Tile, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `tile` sums as BASE does here, bit for bit in float32: checked on the first call (rows 40 of 16-, 64- and
    128-row tiles, 80 columns; K 1008 in one split and K 4112 in 26 splits of 160, which end inside a 64- or
    128-deep K step; both launches), remembered for the process. A call during a CUDA graph's capture cannot run
    the check: it takes BASE and remembers nothing (the engine's eager step before each capture runs it)."""
    key = (tile, device, dtype)
    if key not in _AGREES:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        _AGREES[key] = _same_sums(tile, device, dtype)
        if not _AGREES[key] and device.type == "cuda":
            warnings.warn(f"bitwise mode: the {tile} matmul tile sums differently from {BASE} on "
                          f"{torch.cuda.get_device_name(device)} ({dtype}); every call takes {BASE} (slower, "
                          "the same exactness)", RuntimeWarning, stacklevel=3)
    return _AGREES[key]


def _same_sums(tile: Tile, device: torch.device, dtype: torch.dtype) -> bool:
    g = torch.Generator().manual_seed(0)
    for K in CHECK_DEPTHS:
        x = torch.randn(CHECK_ROWS, K, generator=g).to(device, dtype)
        w = (torch.randn(CHECK_COLS, K, generator=g) / K ** 0.5).to(device, dtype)
        try:
            want = matmul(x, w, launch="tiles", tile=BASE)
            if not all(torch.equal(matmul(x, w, launch=launch, tile=tile), want) for launch in ("splits", "tiles")):
                return False
        except triton.runtime.errors.OutOfResources:  # a tile too big for this GPU's shared memory
            return False
    return True


def matmul(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
           out_dtype: torch.dtype = torch.float32, launch: str = "auto", residual: Optional[torch.Tensor] = None,
           tile: Optional[Tile] = None) -> torch.Tensor:
    """x [N, K] @ w [M, K].T -> [N, M] in out_dtype (+ bias [M] after that rounding, + residual [N, M] of out_dtype
    after that), batch-invariant (see the module docstring): invariant.linear's `residual + (matmul(x, w).to(dtype)
    + bias)`. `launch` changes the speed, never the bits: "splits" a program per (tile, split) into a float32
    workspace [S, N, M], then _sum_splits_kernel; "tiles" a program per tile adding its splits itself; "auto" splits
    while the tiles alone would not fill the GPU. tile: another configuration than tile_for's (agrees, benchmarks)."""
    if launch not in LAUNCHES:
        raise ValueError(f"invariant_triton.matmul: launch={launch!r}; choose one of {LAUNCHES}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    N, K = x.shape
    M = w.shape[0]
    out = torch.empty(N, M, dtype=out_dtype, device=x.device)
    if N == 0 or M == 0:
        return out
    if residual is not None:
        assert residual.shape == (N, M) and residual.dtype == out_dtype, (residual.shape, residual.dtype)
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    S, KS = k_splits(K, M)
    b = out if bias is None else bias
    r, r_sn = (out, 0) if residual is None else (residual, residual.stride(0))
    ends = dict(HAS_BIAS=bias is not None, HAS_RES=residual is not None)

    def run(tile: Tile) -> torch.Tensor:
        tiles = (triton.cdiv(N, tile.block_m), triton.cdiv(M, tile.block_n))
        spread = S > 1 and (launch == "splits" or (launch == "auto" and tiles[0] * tiles[1] < FILL_PROGRAMS))
        common = dict(IEEE=x.dtype == torch.float32, BM=tile.block_m, BN=tile.block_n, BK=tile.block_k,
                      num_warps=tile.warps, num_stages=tile.stages)
        if not spread:
            _matmul_kernel[(*tiles, 1)](x, w, b, r, out, N, M, K, KS, S, x.stride(0), w.stride(0), out.stride(0),
                                        r_sn, PARTIAL=False, **ends, **common)
            return out
        partials = torch.empty(S, N, M, dtype=torch.float32, device=x.device)  # [S, N, M]
        _matmul_kernel[(*tiles, S)](x, w, b, r, partials, N, M, K, KS, S, x.stride(0), w.stride(0), M, 0,
                                    HAS_BIAS=False, HAS_RES=False, PARTIAL=True, **common)
        _sum_splits_kernel[(triton.cdiv(N, SUM_ROWS), triton.cdiv(M, SUM_COLS))](
            partials, b, r, out, N, M, out.stride(0), r_sn, S=S, BR=SUM_ROWS, BC=SUM_COLS, **ends)
        return out

    chosen = tile is None
    tile = tile_for(N, M, x.device, x.dtype, S) if chosen else tile
    return _fitting(run, "matmul", tile, chosen, x.device, x.dtype)


def groupable(K: int, weights: Sequence[torch.Tensor]) -> bool:
    """matmul_group takes these weights [M_j, K]: two or three of them, each one split (k_splits); GROUP on."""
    return GROUP and len(weights) in (2, 3) and all(w.shape[1] == K and k_splits(K, w.shape[0])[0] == 1
                                                    for w in weights)


def matmul_group(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]],
                 out_dtype: torch.dtype) -> list[torch.Tensor]:
    """[matmul(x, w_j, b_j, out_dtype) for each weight] in one launch (q/k/v, gate/up): x [N, K], weights [M_j, K]
    (groupable), biases all tensors or all None -> [N, M_j] each, every element the bits of its own call's."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    ws = [w if w.stride(-1) == 1 else w.contiguous() for w in weights]
    N, K = x.shape
    outs = [torch.empty(N, w.shape[0], dtype=out_dtype, device=x.device) for w in ws]
    if N == 0:
        return outs
    has_bias = biases[0] is not None
    pad = lambda items: list(items) + [items[-1]] * (3 - len(items))  # noqa: E731  a third slot never reached
    w3, o3 = pad(ws), pad(outs)
    b3 = pad(list(biases)) if has_bias else o3

    def run(tile: Tile) -> list[torch.Tensor]:
        counts = [triton.cdiv(w.shape[0], tile.block_n) for w in ws]
        _group_kernel[(triton.cdiv(N, tile.block_m), sum(counts))](
            x, *w3, *b3, *o3, N, *[w.shape[0] for w in w3], counts[0], counts[1], K, x.stride(0),
            *[w.stride(0) for w in w3], *[o.stride(0) for o in o3], IEEE=x.dtype == torch.float32, HAS_BIAS=has_bias,
            BM=tile.block_m, BN=tile.block_n, BK=tile.block_k, num_warps=tile.warps, num_stages=tile.stages)
        return outs

    tile = tile_for(N, sum(w.shape[0] for w in ws), x.device, x.dtype, kernel="group")
    return _fitting(run, "group", tile, True, x.device, x.dtype)


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
    block_q, block_keys = attention_blocks(D)
    grid = (n, triton.cdiv(T, block_q), Hq)
    _attention_kernel[grid](q, qpos, k, v, out, T, L, float(scale), int(window or 0),
                            q.stride(0), q.stride(1), q.stride(2), qpos.stride(0), qpos.stride(1),
                            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                            out.stride(0), out.stride(1), out.stride(2),
                            GROUP=Hq // Hkv, D=D, BD=BD, BQ=block_q, BKEYS=block_keys, WINDOW=window is not None,
                            IEEE=q.dtype == torch.float32, num_warps=ATTENTION_WARPS)
    return out
