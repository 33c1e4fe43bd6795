"""Triton kernels for the extend pass (multi-turn continuation): the new tokens' KV write and their attention
over each row's slot, read in place.

  write_kv          the new k/v of every token (row r, token j) into the cache at (slots[r], :, pos[r, j]):
                    one launch for keys and values (the torch path's two index_put's, with their index and
                    copy launches).
  prepare           the layer's raw q/k/v (one [q; k; v] GEMM's output) made ready: biases, per-head norm and
                    RoPE (as the decode kernel's prologue), q returned, k/v written as write_kv does; what the
                    fused extend layer (fused.py) runs instead of layers.pre_attention's kernels and write_kv.
  extend_attention  M query tokens per row against the cached keys of the row's slot: token j of row r, at
                    position p = pos[r, j], sees positions [0, p] (its own key included, written before), a
                    sliding layer's only those > p - window, and never past `context`; a padding token
                    (j >= lengths[r]) sees no window, so that it always sees key 0 (finite, unused). Online
                    softmax in float32; no gathered copy of the cache, no [C, M, ctx] mask, no scores in memory.
Program (row, kv head, block of TOKENS query tokens): the q tile packs the G query heads of each token as
consecutive rows ([TOKENS * G, D], padded to a power of two), so one tl.dot serves the whole group as the decode
kernel's packed rows do; the program walks the key blocks from its tokens' lowest visible position (0 for full
layers) to their highest, masking each tile row by its own token's position.
The torch twin (torch_path.extend_attention over a gathered cache with a mask, and index_put writes) runs on the CPU,
without Triton, and for head_dim > MAX_HEAD_DIM (Gemma 4's global layers, 512: a [rows, 512] float32 accumulator
per program is past what the launch settings below were sized for). Runs inside CUDA graphs (no host sync: rows,
positions and lengths are read on the device; context is a Python int, fixed per captured bucket).
tests/test_rollout_extend_kernel.py compares both under TRITON_INTERPRET=1.
Not here: the decode step's attention (kernels.py), the layer math around it (runner.py).

Legend: C rows, M tokens per row (right-padded), Hq/Hkv heads, G = Hq / Hkv, D head_dim, S slot_len, ctx context.
"""
from __future__ import annotations

from typing import Optional

import torch

from phaserl.rollout import kernels

MAX_HEAD_DIM = 256
# Launch settings, not swept (H200, 2026-12-03: 56 us a layer for 256 rows x 33 tokens at 0.5B): chosen so that ptxas
# (Triton 3.6, sm_90, compiled here ahead of time) spills no register. A program's q tile is EXTEND_ROWS x 64 elements
# (rows halved per doubling of head_dim past 64, and for float32), keys in blocks of EXTEND_BLOCK_N (32 past head_dim 64
# and for float32). bf16: 128 rows x 64 keys at D = 64 use 239 registers a thread with 8 warps (4 warps spill), 64 x 32
# at D = 128 192, 32 x 32 at D = 256 222; float32 (IEEE dots) 64 x 32 at D = 64 144.
EXTEND_ROWS, EXTEND_BLOCK_N, EXTEND_WARPS, EXTEND_STAGES = 128, 64, 8, 2

if kernels.HAVE_TRITON:
    import triton
    import triton.language as tl

    # M, context and window change from one eager pass to the next: not specialized (by value 1 or divisibility
    # by 16), so that they compile no new variants.
    @triton.jit(do_not_specialize=["M"])
    def _write_kv_kernel(k_ptr, v_ptr, keys_ptr, values_ptr, slots_ptr, pos_ptr, M, k_st, k_sh, v_st, v_sh,
                         c_sb, c_sh, c_ss, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_D: tl.constexpr):
        """Program (token r * M + j): its Hkv heads of k and v into the cache at (slots[r], :, pos[r, j])."""
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots_ptr + token // M).to(tl.int64)
        p = tl.load(pos_ptr + token)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        ok = (h < HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        at = slot * c_sb + h[:, None] * c_sh + p * c_ss + d[None, :]  # [BLOCK_H, BLOCK_D]
        tl.store(keys_ptr + at, tl.load(k_ptr + token * k_st + h[:, None] * k_sh + d[None, :], mask=ok), mask=ok)
        tl.store(values_ptr + at, tl.load(v_ptr + token * v_st + h[:, None] * v_sh + d[None, :], mask=ok), mask=ok)

    @triton.jit(do_not_specialize=["M"])
    def _prepare_kernel(q_ptr, k_ptr, v_ptr, qb_ptr, kb_ptr, vb_ptr, qn_ptr, kn_ptr, eps, cos_ptr, sin_ptr,
                        keys_ptr, values_ptr, slots_ptr, pos_ptr, out_ptr, M, q_st, k_st, v_st, cos_ss, c_sb, c_sh,
                        c_ss, o_st, HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr,
                        HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, STYLE: tl.constexpr, ROPE: tl.constexpr):
        """Program (token r * M + j): its raw q/k/v (views into one [q; k; v] GEMM output) + bias, per-head
        RMS-norm, RoPE at its position (kernels._load_head: rounded as layers.pre_attention rounds); q into
        out, k and v into the cache at (slots[r], :, pos[r, j])."""
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots_ptr + token // M).to(tl.int64)
        p = tl.load(pos_ptr + token)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        cos, sin = kernels._rope_at(cos_ptr, sin_ptr, p, cos_ss, d, d_ok, BLOCK_D, ROPE)  # [BLOCK_D] each
        hq = tl.arange(0, BLOCK_Q)
        q_ok = (hq < HQ)[:, None] & d_ok[None, :]
        q = kernels._load_head(q_ptr, qb_ptr, qn_ptr, eps, cos, sin, token * q_st, hq, d, q_ok, HEAD_DIM, HAS_BIAS,
                               QK_NORM, STYLE, ROPE)  # [BLOCK_Q, BLOCK_D]
        tl.store(out_ptr + token * o_st + hq[:, None] * HEAD_DIM + d[None, :], q, mask=q_ok)
        hk = tl.arange(0, BLOCK_KV)
        kv_ok = (hk < HKV)[:, None] & d_ok[None, :]
        k = kernels._load_head(k_ptr, kb_ptr, kn_ptr, eps, cos, sin, token * k_st, hk, d, kv_ok, HEAD_DIM, HAS_BIAS,
                               QK_NORM, STYLE, ROPE)
        v = kernels._load_head(v_ptr, vb_ptr, v_ptr, eps, cos, sin, token * v_st, hk, d, kv_ok, HEAD_DIM, HAS_BIAS,
                               False, STYLE, False)
        at = slot * c_sb + hk[:, None] * c_sh + p * c_ss + d[None, :]  # [BLOCK_KV, BLOCK_D]
        tl.store(keys_ptr + at, k, mask=kv_ok)
        tl.store(values_ptr + at, v, mask=kv_ok)

    @triton.jit
    def _extend_block(q, k_head, v_head, start, lo, hi, first, last, c_ss, d, d_ok, scale, m, total, acc,
                      BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        """Online-softmax update of (m, total, acc) [ROWS], [ROWS], [ROWS, BLOCK_D] with the cached keys
        [start, start + BLOCK_N) of one (slot, kv head) (k_head, v_head: its position 0); tile row i sees keys in
        [lo[i], hi[i]). Nothing outside [first, last) (what some row sees) is loaded: a position no token of the
        program sees is never read, whatever it holds."""
        keys_at = start + tl.arange(0, BLOCK_N)
        k_ok = (keys_at >= first) & (keys_at < last)
        offsets = keys_at[:, None] * c_ss + d[None, :]  # int32 within one head's S x D: fewer registers than int64
        k = tl.load(k_head + offsets, mask=k_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_head + offsets, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:  # float32 models: full precision, as the torch path computes (bf16 under the interpreter: exact
            # products of the bf16 numbers, the same p rounding)
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # [ROWS, BLOCK_N] float32
        seen = (keys_at[None, :] >= lo[:, None]) & (keys_at[None, :] < hi[:, None])
        s = tl.where(seen, s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp(-inf) = 0, not NaN
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, total, acc

    @triton.jit(do_not_specialize=["window", "context", "M"])
    def _extend_attention_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, pos_ptr, lengths_ptr, out_ptr, scale, window,
                                 context, M, q_st, q_sh, c_sb, c_sh, c_ss, o_st,
                                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, TOKENS: tl.constexpr,
                                 ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                                 IEEE: tl.constexpr, PER_ROW_BOUND: tl.constexpr, INTERPRET_KEYS: tl.constexpr):
        """Program (row, kv head, block): query tokens [block * TOKENS, (block + 1) * TOKENS) of the row, each with
        the GROUP query heads of this kv head; tile row i is token i // GROUP, head i % GROUP (ROWS >= TOKENS * GROUP,
        the rest padding)."""
        row = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        i = tl.arange(0, ROWS)
        j = tl.program_id(2) * TOKENS + i // GROUP  # [ROWS] the tile row's token in the row
        heads = kv_head * GROUP + i % GROUP          # [ROWS] its query head
        d = tl.arange(0, BLOCK_D)
        j_ok = (i < TOKENS * GROUP) & (j < M)
        d_ok = d < HEAD_DIM
        token = row * M + j  # [ROWS] int64: index into the C * M flattened tokens
        p = tl.load(pos_ptr + token, mask=j_ok, other=0).to(tl.int32)  # [ROWS] the token's position (< S)
        real = j < tl.load(lengths_ptr + row)
        lo = tl.where(real, p - window + 1, 0)  # the first key it sees (no window: window > S, lo < 0)
        hi = tl.minimum(p + 1, context)          # one past the last
        slot = tl.load(slots_ptr + row).to(tl.int64)
        k_head = k_ptr + slot * c_sb + kv_head * c_sh  # this (slot, kv head)'s position 0
        v_head = v_ptr + slot * c_sb + kv_head * c_sh
        q = tl.load(q_ptr + token[:, None] * q_st + heads[:, None] * q_sh + d[None, :],
                    mask=j_ok[:, None] & d_ok[None, :], other=0.0)  # [ROWS, BLOCK_D]
        m = tl.full([ROWS], float("-inf"), tl.float32)
        total = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
        # The key blocks some token of this program sees: from its lowest first key (0 for full layers) to its
        # highest last one.
        first = tl.maximum(tl.min(tl.where(j_ok, lo, context), axis=0), 0)
        last = tl.max(tl.where(j_ok, hi, 0), axis=0)
        if PER_ROW_BOUND:
            for start in range((first // BLOCK_N) * BLOCK_N, last, BLOCK_N):
                m, total, acc = _extend_block(q, k_head, v_head, start, lo, hi, first, last, c_ss, d, d_ok,
                                              scale, m, total, acc, BLOCK_N, IEEE)
        else:  # the interpreter cannot loop to a loaded bound: every block of the context, the loads (and so each
            # row's keys) within [first, last) as in the loop above (so the CPU tests check those bounds too)
            for start in range(0, INTERPRET_KEYS, BLOCK_N):
                m, total, acc = _extend_block(q, k_head, v_head, start, lo, hi, first, last, c_ss, d, d_ok,
                                              scale, m, total, acc, BLOCK_N, IEEE)
        out = acc / total[:, None]  # every real tile row saw at least key 0 or its own: total > 0
        tl.store(out_ptr + token[:, None] * o_st + heads[:, None] * HEAD_DIM + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=j_ok[:, None] & d_ok[None, :])


def supports(head_dim: int) -> bool:
    """Whether these kernels take a layer of this head_dim (else the torch path: see the module docstring)."""
    return head_dim <= MAX_HEAD_DIM


def write_kv(k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
             pos: torch.Tensor) -> None:
    """The new k/v [C * M, Hkv, D] into keys/values [num_slots, Hkv, S, D] at (slots[r], :, pos[r, j]) for token
    r * M + j; slots [C], pos [C, M] int64 (a position written twice, a row's clamped padding, takes either)."""
    C, M = pos.shape
    Hkv, D = keys.shape[1], keys.shape[3]
    assert k.shape == v.shape == (C * M, Hkv, D) and k.stride(-1) == v.stride(-1) == 1
    assert keys.stride() == values.stride() and keys.stride(-1) == 1 and pos.is_contiguous()
    _write_kv_kernel[(C * M,)](k, v, keys, values, slots, pos, M, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               keys.stride(0), keys.stride(1), keys.stride(2), HEADS=Hkv, HEAD_DIM=D,
                               BLOCK_H=triton.next_power_of_2(Hkv), BLOCK_D=triton.next_power_of_2(D), num_warps=1)


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            slots: torch.Tensor, pos: torch.Tensor, *, rope: tuple[torch.Tensor, torch.Tensor],
            bias: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
            qk_norm: Optional[tuple[torch.Tensor, torch.Tensor, float, str]] = None) -> torch.Tensor:
    """The raw projections q [C * M, Hq, D], k/v [C * M, Hkv, D] (views into one [q; k; v] GEMM output, no bias)
    -> q ready for extend_attention [C * M, Hq, D]; k and v, ready too, written into keys/values [num_slots, Hkv,
    S, D] at (slots[r], :, pos[r, j]). In one launch what layers.pre_attention does after its GEMM (the biases,
    `qk_norm` = (q_norm [D], k_norm [D], eps, style) per head, RoPE from `rope` = (cos, signed sin) [S, D] at each
    token's position) plus write_kv: kernels.decode_attention's prologue, for every token of the pass."""
    C, M = pos.shape
    Hq, D, Hkv = q.shape[1], q.shape[2], k.shape[1]
    for t in (q, k, v):
        assert t.stride(-1) == 1 and t.stride(-2) == D, "heads must be contiguous within a token"
    assert q.shape[0] == k.shape[0] == v.shape[0] == C * M and keys.stride() == values.stride() and pos.is_contiguous()
    out = torch.empty(C * M, Hq, D, dtype=q.dtype, device=q.device)
    qb, kb, vb = bias if bias is not None else (q, q, q)  # unread without HAS_BIAS
    q_norm, k_norm, eps, style = qk_norm if qk_norm is not None else (q, q, 0.0, "llama")
    cos, sin = rope
    _prepare_kernel[(C * M,)](q, k, v, qb, kb, vb, q_norm, k_norm, eps, cos, sin, keys, values, slots, pos, out, M,
                              q.stride(0), k.stride(0), v.stride(0), cos.stride(0), keys.stride(0), keys.stride(1),
                              keys.stride(2), out.stride(0), HQ=Hq, HKV=Hkv, HEAD_DIM=D,
                              BLOCK_Q=triton.next_power_of_2(Hq), BLOCK_KV=triton.next_power_of_2(Hkv),
                              BLOCK_D=max(16, triton.next_power_of_2(D)), HAS_BIAS=bias is not None,
                              QK_NORM=qk_norm is not None, STYLE=kernels.NORM_STYLES[style], ROPE=True,
                              num_warps=4)
    return out


def extend_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                     pos: torch.Tensor, lengths: torch.Tensor, context: int, scale: Optional[float] = None,
                     window: Optional[int] = None, *, rows: Optional[int] = None, block_n: Optional[int] = None,
                     num_warps: Optional[int] = None, num_stages: Optional[int] = None) -> torch.Tensor:
    """q [C * M, Hq, D] (token r * M + j), cache keys/values [num_slots, Hkv, S, D] (the new keys already written),
    slots/lengths [C], pos [C, M] int64 -> [C * M, Hq * D] in q's dtype.

    Token j of row r attends positions [0, pos[r, j]] of slot slots[r], below `context` (<= S), a sliding layer's
    only those > pos[r, j] - window (real tokens, j < lengths[r]; padding tokens see no window): what
    torch_path.extend_attention computes over keys[slots, :, :context] with torch_path.extend_mask's mask. scale: of the
    scores (None: D ** -0.5). rows, block_n, num_warps, num_stages: launch settings (None: the module's).
    """
    C, M = pos.shape
    Hq, D = q.shape[1], q.shape[2]
    Hkv, S = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    assert q.shape[0] == C * M and q.stride(-1) == 1 and supports(D) and context <= S
    assert keys.stride() == values.stride() and keys.stride(-1) == 1 and pos.is_contiguous()
    out = torch.empty(C * M, Hq * D, dtype=q.dtype, device=q.device)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    wide = 2 if q.dtype == torch.float32 else 1  # float32 tiles take twice the registers
    rows = rows or max(16, EXTEND_ROWS * 64 // max(64, BLOCK_D) // wide)  # the q tile [rows, BLOCK_D]
    block_n = block_n or (EXTEND_BLOCK_N if BLOCK_D <= 64 and wide == 1 else 32)
    # Tokens per program: as many whole groups as fit, fewer for a short extension (rounded to a power of two,
    # so that the eager pass's ragged M compiles a few variants, not one per M).
    tokens = max(1, min(rows // G, triton.next_power_of_2(M)))
    ROWS = max(16, triton.next_power_of_2(tokens * G))  # tl.dot needs >= 16 rows
    _extend_attention_kernel[(C, Hkv, triton.cdiv(M, tokens))](
        q, keys, values, slots, pos, lengths, out, D ** -0.5 if scale is None else scale,
        S + 1 if window is None else int(window), context, M, q.stride(0), q.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), out.stride(0),
        GROUP=G, HEAD_DIM=D, TOKENS=tokens, ROWS=ROWS, BLOCK_D=BLOCK_D,
        # IEEE under the interpreter too: its bf16 tl.dot returns garbage (Triton 3.6), so operands go float32 there
        BLOCK_N=block_n, IEEE=q.dtype == torch.float32 or kernels.INTERPRET,
        PER_ROW_BOUND=not kernels.INTERPRET, INTERPRET_KEYS=context if kernels.INTERPRET else 0,
        num_warps=num_warps or EXTEND_WARPS, num_stages=num_stages or EXTEND_STAGES)
    return out
