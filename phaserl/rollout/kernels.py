"""Triton kernels for the decode step: attention over each row's used context, norms, the gated activation and
the slot-state update (the sampler's: sample_kernel.py).

  decode_attention  one query token per row against its slot's cached keys/values [0, pos) (a sliding
                    layer's: the window before pos), plus the row's own new key/value, which the
                    kernel also writes into the cache at `pos`. Optionally adds the q/k/v biases and
                    applies RoPE first (then q/k/v are raw views into the [q; k; v] GEMM output).
                    Reads K/V only up to each row's length (the torch fallback reads the whole slot),
                    online softmax in float32, grouped-query heads share each K/V load; with few rows each
                    row's keys are split into equal runs (sized from its own length), one program each,
                    merged by a second small kernel (flash-decoding).
  rms_norm          layers.rms_norm (every rounding style) in one kernel; add_rms_norm adds a residual first.
  gated             layers.activation(gate) * up from the [gate; up] GEMM output.
  record            kv_pool.SlotState.record: the step's tokens and log-probs into the slot state.
All run inside CUDA graphs (no host sync; the positions live in device tensors).
The pure-torch versions of the same math live in layers.py, runner.py and kv_pool.py and are used on the CPU
and without Triton; tests/test_rollout_fused.py compares each kernel with its twin.
Not here: sampling (sample_kernel.py), prefill attention (SDPA).

Legend: b rows, Hq/Hkv heads, G = Hq / Hkv, D head_dim, S slot_len, V vocab.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter: how the kernels are tested here
# Launch settings, swept on an H200 at the reference shape inside CUDA graphs (BENCHMARKS.md;
# `benchmarks/rollout.py --case ours --profile --sweep`). Attention at 512 rows: one program per (row, kv head)
# over its whole context, 30.4 us a layer; split into 128-key chunks 35.7 us (each split repeats the q/RoPE
# prologue, plus the merge). So keys are split only when (rows x kv heads) programs leave SMs idle: below
# SPLIT_PROGRAMS programs, into at most slot_len / MIN_CHUNK runs, each row's runs sized from its own length at run
# time (at the GRPO shapes' 128-512 rows one split was the fastest, at 3-4 TB/s; with 32-64 rows the per-row runs
# took 9.8-11.2 us against 11.8-15.1 for fixed chunks of the slot at short contexts: BENCHMARKS.md, eighteenth
# session, benchmarks/decode_attention.py).
# Two warps instead of four for heads of at most 64 dims when the keys are not split: at 512 rows of the 0.5B shape
# (1,024 programs) four warps fit 6 programs per SM (registers and shared memory alike; Nsight Compute: 1.29 waves,
# a tail of 233 programs), two fit all of them at once: 24.6 against 26.6 us a layer (2026-12-04, H200; 28.3 against
# 30.2 in a second run). Wider heads keep four (head_dim 128 at the 1.5B and 7B shapes: 65.4 against 62.3 us and
# 43.6 against 42.0 with two).
# MAX_RUN_KEYS bounds a run in slots of LONG_SLOT keys or more (mixed lengths: the split count is fixed per graph, so
# at a 256-row bucket, 1 run, a row near a 4k context walked all its keys after the short rows were done). 0.5B,
# 4,224-key slots, mixed contexts, H100: 102 -> 53 us a layer at 256 rows, 60 -> 43 at 192 (decode_attention.py
# --case 0.5b-mixed); the same bytes at one even context: 41 -> 51 us, so shorter slots keep the rule above alone.
# ROW_RUNS: in those slots, runs of MAX_RUN_KEYS keys, as many as each row needs (a short row's empty programs return at
# once). H100, 2026-12-06, 256 rows: 0.5B 54.6 -> 50.1 us a layer (mixed), 51.9 -> 46.6 (even); 1.5B 98.0 -> 86.3
# and 95.3 -> 82.0; long_tail.py k = 3: 1.544x -> 1.589x sync. Slots under LONG_SLOT are not touched.
ATTENTION_BLOCK_N, ATTENTION_WARPS, ATTENTION_STAGES = 64, 4, 2
NARROW_HEAD, NARROW_WARPS = 64, 2
SPLIT_PROGRAMS, MIN_CHUNK = 512, 128
MAX_RUN_KEYS, LONG_SLOT = 512, 4096  # None: no bound
ROW_RUNS = True  # long slots: runs of MAX_RUN_KEYS, as many as a row needs
GATED_BLOCK = 1024

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _attend_block(q, k_ptr, v_ptr, cache, start, lo, hi, c_ss, d, d_ok, scale, m, total, acc,
                      BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        """Online-softmax update of (m, total, acc) with cached keys [start, start + BLOCK_N) in [lo, hi)."""
        keys_at = start + tl.arange(0, BLOCK_N)
        k_ok = (keys_at < hi) & (keys_at >= lo)
        offsets = cache + keys_at[:, None] * c_ss + d[None, :]
        k = tl.load(k_ptr + offsets, mask=k_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + offsets, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:  # float32 models: full precision, as the torch path computes
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # [BLOCK_G, BLOCK_N] float32
        s = tl.where(k_ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a split with no key yet: exp(-inf) = 0, not NaN
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, total, acc

    @triton.jit
    def _styled(norm, w, dtype, STYLE: tl.constexpr):
        """The weight applied to a float32 norm where layers.rms_norm's style rounds (see _rms_norm_kernel)."""
        if STYLE == 0:
            y = norm.to(dtype).to(tl.float32) * w
        elif STYLE == 1:
            y = norm * (1.0 + w)
        else:
            y = norm * w
        return y.to(dtype)

    @triton.jit
    def _rope_at(cos_ptr, sin_ptr, pos, cos_ss, d, d_ok, BLOCK_D: tl.constexpr, ROPE: tl.constexpr):
        """The RoPE tables' rows (cos, signed sin) [BLOCK_D] float32 at position `pos` (zeros without ROPE)."""
        if ROPE:
            cos = tl.load(cos_ptr + pos * cos_ss + d, mask=d_ok, other=0.0).to(tl.float32)
            sin = tl.load(sin_ptr + pos * cos_ss + d, mask=d_ok, other=0.0).to(tl.float32)
        else:
            cos = tl.zeros([BLOCK_D], tl.float32)
            sin = tl.zeros([BLOCK_D], tl.float32)
        return cos, sin

    @triton.jit
    def _load_head(ptr, bias_ptr, norm_ptr, eps, cos, sin, offset, heads, d, mask, HEAD_DIM: tl.constexpr,
                   HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, STYLE: tl.constexpr, ROPE: tl.constexpr):
        """Rows `heads` of one token's q, k or v -> [*, BLOCK_D]: + bias, then each head RMS-normed (QK_NORM:
        Qwen3's), then RoPE, each rounded where layers.pre_attention rounds it."""
        at = ptr + offset + heads[:, None] * HEAD_DIM
        x = tl.load(at + d[None, :], mask=mask, other=0.0)
        dtype = x.dtype
        if HAS_BIAS:
            x = (x.to(tl.float32) + tl.load(bias_ptr + heads[:, None] * HEAD_DIM + d[None, :], mask=mask,
                                            other=0.0).to(tl.float32)).to(dtype)
        if QK_NORM:
            xf = x.to(tl.float32)
            rstd = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)  # [rows]
            x = _styled(xf * rstd[:, None], tl.load(norm_ptr + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)[None, :],
                        dtype, STYLE)
        if ROPE:  # x * cos + roll(x, D/2) * signed_sin: the partner lane read again, rounded as torch does
            partner = (d + HEAD_DIM // 2) % HEAD_DIM
            xp = tl.load(at + partner[None, :], mask=mask, other=0.0)
            if HAS_BIAS:
                xp = (xp.to(tl.float32) + tl.load(bias_ptr + heads[:, None] * HEAD_DIM + partner[None, :],
                                                  mask=mask, other=0.0).to(tl.float32)).to(dtype)
            if QK_NORM:
                w_p = tl.load(norm_ptr + partner, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
                xp = _styled(xp.to(tl.float32) * rstd[:, None], w_p[None, :], dtype, STYLE)
            x = ((x.to(tl.float32) * cos[None, :]).to(dtype).to(tl.float32)
                 + xp.to(tl.float32) * sin[None, :]).to(dtype)
        return x

    @triton.jit
    def _row_runs(pos, window, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_RUN: tl.constexpr):
        """(lo, chunk) of a row at `pos`: the first key it sees (a sliding layer's window; window >= slot_len: 0)
        and the keys one run takes, whole BLOCK_N blocks, at least MIN_RUN: what the attention kernel splits and
        the merge reads alike."""
        lo = tl.maximum(pos - window + 1, 0)
        return lo, tl.maximum(tl.cdiv(tl.cdiv(pos - lo, SPLITS), BLOCK_N) * BLOCK_N, MIN_RUN)

    @triton.jit
    def _decode_attention_kernel(q_ptr, kn_ptr, vn_ptr, qb_ptr, kb_ptr, vb_ptr, qn_ptr, kn_norm_ptr, eps, cos_ptr,
                                 sin_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, part_ptr, stat_ptr, scale, window,
                                 q_sb, kn_sb, vn_sb, cos_ss, c_sb, c_sh, c_ss, o_sb,
                                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                                 BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MAX_CHUNK: tl.constexpr,
                                 SPLITS: tl.constexpr, IEEE: tl.constexpr, PER_ROW_BOUND: tl.constexpr,
                                 HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, STYLE: tl.constexpr,
                                 ROPE: tl.constexpr, MIN_RUN: tl.constexpr):
        """Program (row, kv head, split): the split-th of SPLITS equal runs of whole BLOCK_N blocks over the row's
        visible cached keys [lo, pos), sized from this row's own length, so every split has the same work at any
        context. Split 0 also takes the row's own key and writes the new k/v into the cache. One split: the
        output directly; several: (max, sum, acc) per split into part/stat, for _combine_kernel. MIN_RUN > 0:
        runs of at least MIN_RUN keys, so a short row needs fewer than SPLITS; its other programs leave at once."""
        row = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        pos = tl.load(pos_ptr + row)  # this row's new token sits at `pos`; keys [0, pos) are cached
        lo, chunk = _row_runs(pos, window, SPLITS, BLOCK_N, MIN_RUN)
        first = lo + split * chunk
        if MIN_RUN > 0:
            if (split > 0) & (first >= pos):  # a run this row does not need: the merge skips it too
                return
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        g_ok, d_ok = g < GROUP, d < HEAD_DIM
        one = tl.arange(0, 1)
        cos, sin = _rope_at(cos_ptr, sin_ptr, pos, cos_ss, d, d_ok, BLOCK_D, ROPE)  # [BLOCK_D] each
        heads = kv_head * GROUP + g
        q = _load_head(q_ptr, qb_ptr, qn_ptr, eps, cos, sin, row * q_sb, heads, d, g_ok[:, None] & d_ok[None, :],
                       HEAD_DIM, HAS_BIAS, QK_NORM, STYLE, ROPE)  # [BLOCK_G, BLOCK_D]
        kv_mask = (one[:, None] >= 0) & d_ok[None, :]
        k_new = _load_head(kn_ptr, kb_ptr, kn_norm_ptr, eps, cos, sin, row * kn_sb, kv_head + one, d, kv_mask,
                           HEAD_DIM, HAS_BIAS, QK_NORM, STYLE, ROPE)  # [1, BLOCK_D]
        v_new = _load_head(vn_ptr, vb_ptr, vn_ptr, eps, cos, sin, row * vn_sb, kv_head + one, d, kv_mask, HEAD_DIM,
                           HAS_BIAS, False, STYLE, False)
        own = split == 0
        cache = row * c_sb + kv_head * c_sh
        write = kv_mask & ((one[:, None] + split) == 0)  # [1, BLOCK_D]: split 0 only
        tl.store(k_ptr + cache + pos * c_ss + d[None, :], k_new, mask=write)
        tl.store(v_ptr + cache + pos * c_ss + d[None, :], v_new, mask=write)
        # The row's own key (split 0 only): always visible, so that split's running max starts finite.
        s_own = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1) * scale  # [BLOCK_G]
        m = tl.where(own, s_own, float("-inf"))
        total = tl.where(own, 1.0, 0.0) + tl.zeros([BLOCK_G], tl.float32)
        acc = tl.where(own, v_new.to(tl.float32), 0.0) + tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        hi = tl.minimum(pos, first + chunk)
        if PER_ROW_BOUND:
            for start in range(first, hi, BLOCK_N):
                m, total, acc = _attend_block(q, k_ptr, v_ptr, cache, start, first, hi, c_ss, d, d_ok, scale, m,
                                              total, acc, BLOCK_N, IEEE)
        else:  # the interpreter cannot loop to a loaded bound; masked lanes load nothing either way
            for start in range(0, MAX_CHUNK, BLOCK_N):
                m, total, acc = _attend_block(q, k_ptr, v_ptr, cache, first + start, first, hi, c_ss, d, d_ok,
                                              scale, m, total, acc, BLOCK_N, IEEE)
        gd_ok = g_ok[:, None] & d_ok[None, :]
        if SPLITS == 1:
            out = acc / total[:, None]
            tl.store(out_ptr + row * o_sb + heads[:, None] * HEAD_DIM + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=gd_ok)
        else:
            at = ((row * tl.num_programs(1) + kv_head) * SPLITS + split) * GROUP + g  # [BLOCK_G] partial rows
            tl.store(part_ptr + at[:, None] * HEAD_DIM + d[None, :], acc, mask=gd_ok)
            tl.store(stat_ptr + at * 2, m, mask=g_ok)
            tl.store(stat_ptr + at * 2 + 1, total, mask=g_ok)

    @triton.jit
    def _combine_kernel(part_ptr, stat_ptr, out_ptr, pos_ptr, window, o_sb, GROUP: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                        SPLITS: tl.constexpr, MIN_RUN: tl.constexpr):
        """Program (row, kv head): merge the splits' softmax partials (flash-decoding's second pass), the runs the
        row used only (MIN_RUN > 0: the attention kernel's rule)."""
        row = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        pos = tl.load(pos_ptr + row)
        runs = SPLITS
        if MIN_RUN > 0:
            lo, chunk = _row_runs(pos, window, SPLITS, BLOCK_N, MIN_RUN)
            runs = tl.maximum(tl.cdiv(pos - lo, chunk), 1)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        g_ok, d_ok = g < GROUP, d < HEAD_DIM
        gd_ok = g_ok[:, None] & d_ok[None, :]
        base = (row * tl.num_programs(1) + kv_head) * SPLITS * GROUP
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for s in range(0, SPLITS):
            m_s = tl.load(stat_ptr + (base + s * GROUP + g) * 2, mask=g_ok & (s < runs), other=0.0)
            m = tl.maximum(m, tl.where(s < runs, m_s, float("-inf")))
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for s in range(0, SPLITS):
            at, used = base + s * GROUP + g, s < runs
            weight = tl.exp(tl.load(stat_ptr + at * 2, mask=g_ok & used, other=0.0) - m)  # empty: exp(-inf) = 0
            weight = tl.where(used, weight, 0.0)
            total += weight * tl.load(stat_ptr + at * 2 + 1, mask=g_ok & used, other=1.0)  # padding rows: no 0 / 0
            acc += weight[:, None] * tl.load(part_ptr + at[:, None] * HEAD_DIM + d[None, :], mask=gd_ok & used,
                                             other=0.0)
        heads = kv_head * GROUP + g
        tl.store(out_ptr + row * o_sb + heads[:, None] * HEAD_DIM + d[None, :],
                 (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=gd_ok)

    @triton.jit
    def _rms_norm_kernel(x_ptr, r_ptr, h_ptr, w_ptr, out_ptr, x_sb, r_sb, h_sb, o_sb, eps, H: tl.constexpr,
                         BLOCK: tl.constexpr, STYLE: tl.constexpr, RESIDUAL: tl.constexpr):
        """One row: float32 statistics, the weight applied where layers.rms_norm's style rounds it
        (0 llama: w * bf16(norm); 1 gemma: norm * (1 + w); 2 olmo2: w * norm). RESIDUAL: x + r first
        (rounded, stored to h: the residual stream), and that is normed."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < H
        x = tl.load(x_ptr + row * x_sb + cols, mask=ok, other=0.0)
        dtype = x.dtype
        if RESIDUAL:
            x = (x.to(tl.float32) + tl.load(r_ptr + row * r_sb + cols, mask=ok, other=0.0).to(tl.float32)).to(dtype)
            tl.store(h_ptr + row * h_sb + cols, x, mask=ok)
        x = x.to(tl.float32)
        norm = x / tl.sqrt_rn(tl.sum(x * x, axis=0) / H + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * o_sb + cols, _styled(norm, w, dtype, STYLE), mask=ok)

    @triton.jit
    def _gated_kernel(x_ptr, out_ptr, x_sb, o_sb, WIDTH: tl.constexpr, BLOCK: tl.constexpr, GELU: tl.constexpr):
        """[gate | up] -> act(gate) * up, rounded as torch rounds activation(gate) * up (act first)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < WIDTH
        gate = tl.load(x_ptr + row * x_sb + cols, mask=ok, other=0.0)
        dtype = gate.dtype
        gate = gate.to(tl.float32)
        up = tl.load(x_ptr + row * x_sb + WIDTH + cols, mask=ok, other=0.0).to(tl.float32)
        if GELU:  # tanh approximation; tanh(u) = 1 - 2 / (exp(2u) + 1)
            u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))
        else:
            act = gate / (1.0 + tl.exp(-gate))
        tl.store(out_ptr + row * o_sb + cols, (act.to(dtype).to(tl.float32) * up).to(dtype), mask=ok)

    @triton.jit
    def _record_kernel(new_ptr, lp_ptr, tokens_ptr, pos_ptr, n_gen_ptr, max_new_ptr, finished_ptr, out_tokens_ptr,
                       out_lp_ptr, stop_ptr, b, out_sb, trash, STOPS: tl.constexpr, BLOCK: tl.constexpr):
        """SlotState.record for BLOCK rows: store each running row's token and log-prob at its n_gen column (idle
        rows: the trash column), then count it, stop it (a stop id, or its cap) and move it on."""
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = rows < b
        new = tl.load(new_ptr + rows, mask=ok, other=0)
        active = (tl.load(finished_ptr + rows, mask=ok, other=1) == 0) & ok
        n_gen = tl.load(n_gen_ptr + rows, mask=ok, other=0)
        column = tl.where(active, n_gen, trash)
        tl.store(out_tokens_ptr + rows.to(tl.int64) * out_sb + column, new, mask=ok)
        tl.store(out_lp_ptr + rows.to(tl.int64) * out_sb + column, tl.load(lp_ptr + rows, mask=ok, other=0.0), mask=ok)
        n_gen += active.to(n_gen.dtype)
        stops = tl.load(stop_ptr + tl.arange(0, STOPS))  # [STOPS], -1 = unused
        is_stop = tl.max((new[:, None] == stops[None, :]).to(tl.int32), axis=1) > 0
        cap = tl.load(max_new_ptr + rows, mask=ok, other=0)
        stop = active & (is_stop | (n_gen >= cap))
        tl.store(n_gen_ptr + rows, n_gen, mask=ok)
        tl.store(finished_ptr + rows, stop, mask=ok & active)
        tl.store(tokens_ptr + rows, new, mask=ok & active)
        tl.store(pos_ptr + rows, tl.load(pos_ptr + rows, mask=ok, other=0) + active.to(tl.int64), mask=ok & active)

def available(device: torch.device) -> bool:
    """The kernels run on CUDA when Triton is installed (and on the CPU under TRITON_INTERPRET=1)."""
    return HAVE_TRITON and (device.type == "cuda" or INTERPRET)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     pos: torch.Tensor, scale: Optional[float] = None, window: Optional[int] = None, *,
                     bias: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                     rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                     qk_norm: Optional[tuple[torch.Tensor, torch.Tensor, float, str]] = None,
                     block_n: Optional[int] = None,
                     splits: Optional[int] = None, num_warps: Optional[int] = None,
                     num_stages: Optional[int] = None) -> torch.Tensor:
    """q [b, Hq, D], the new k/v [b, Hkv, D], cache keys/values [slots >= b, Hkv, S, D], pos [b] -> [b, Hq * D].

    Writes k/v into the cache at (row, :, pos[row]) and attends over cache positions [0, pos] of each row, or
    [pos - window + 1, pos] for a sliding layer. scale: of the scores (None: D ** -0.5).
    With `bias` (q, k, v biases [heads * D]) and `rope` (layers.rope_tables cos, signed sin [S, D]), q/k/v are
    the raw projections (views into one [q; k; v] GEMM output): the kernel adds the biases and applies RoPE
    at each row's position first (rounded as layers.pre_attention rounds), so the caller needs no other kernel;
    qk_norm = (q_norm [D], k_norm [D], eps, norm style) RMS-norms each q/k head before RoPE (Qwen3's "head").
    The keys each row sees can be split into `splits` equal runs (None: `attention_splits`), each sized from the
    row's own length at run time, one program each, merged by a second kernel (flash-decoding), so that few
    rows or long contexts still fill the SMs.
    """
    b, Hq, D = q.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    for t in (q, k, v):
        assert t.stride(-1) == 1 and t.stride(-2) == D, "heads must be contiguous within a token"
    assert keys.stride(-1) == 1 and keys.stride() == values.stride()
    out = torch.empty(b, Hq, D, dtype=q.dtype, device=q.device)
    G = Hq // Hkv
    BLOCK_G, BLOCK_D = max(16, triton.next_power_of_2(G)), max(16, triton.next_power_of_2(D))
    # Key/value tiles of BLOCK_N x BLOCK_D, pipelined in num_stages copies, must fit in shared memory: head_dim
    # 512 (Gemma 4's global layers) takes half as many keys per block as head_dim <= 256.
    block_n = block_n or min(ATTENTION_BLOCK_N, 16384 // BLOCK_D)
    long = S >= LONG_SLOT and MAX_RUN_KEYS is not None
    splits = splits or attention_splits(b, Hkv, S, MAX_RUN_KEYS if long else None)
    min_run = triton.cdiv(MAX_RUN_KEYS, block_n) * block_n if long and ROW_RUNS and splits > 1 else 0
    max_chunk = max(triton.cdiv(triton.cdiv(S, splits), block_n) * block_n, min_run)  # the interpreter's loop
    part = torch.empty(b, Hkv, splits, G, D if splits > 1 else 1, dtype=torch.float32, device=q.device)
    stat = torch.empty(b, Hkv, splits, G, 2 if splits > 1 else 1, dtype=torch.float32, device=q.device)
    qb, kb, vb = bias if bias is not None else (q, q, q)  # unread without HAS_BIAS
    cos, sin = rope if rope is not None else (q, q)
    q_norm, k_norm, eps, style = qk_norm if qk_norm is not None else (q, q, 0.0, "llama")
    _decode_attention_kernel[(b, Hkv, splits)](
        q, k, v, qb, kb, vb, q_norm, k_norm, eps, cos, sin, keys, values, pos, out, part, stat,
        D ** -0.5 if scale is None else scale,
        S + 1 if window is None else int(window), q.stride(0), k.stride(0), v.stride(0),
        cos.stride(0) if rope is not None else 0, keys.stride(0), keys.stride(1), keys.stride(2), out.stride(0),
        GROUP=G, HEAD_DIM=D, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D, BLOCK_N=block_n, MAX_CHUNK=max_chunk, SPLITS=splits,
        IEEE=q.dtype == torch.float32, PER_ROW_BOUND=not INTERPRET, HAS_BIAS=bias is not None,
        QK_NORM=qk_norm is not None, STYLE=NORM_STYLES[style], ROPE=rope is not None, MIN_RUN=min_run,
        num_warps=num_warps or attention_warps(BLOCK_D, splits), num_stages=num_stages or ATTENTION_STAGES)
    if splits > 1:
        _combine_kernel[(b, Hkv)](part, stat, out, pos, S + 1 if window is None else int(window), out.stride(0),
                                  GROUP=G, HEAD_DIM=D, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D, BLOCK_N=block_n,
                                  SPLITS=splits, MIN_RUN=min_run, num_warps=4)
    return out.view(b, Hq * D)


def attention_splits(rows: int, kv_heads: int, slot_len: int, max_run_keys: Optional[int] = None) -> int:
    """Runs each row's keys are split into (SPLIT_PROGRAMS, MAX_RUN_KEYS above): enough to fill SPLIT_PROGRAMS
    programs and, with max_run_keys, to hold a full slot's run to that many keys; no run under MIN_CHUNK keys."""
    wanted = triton.cdiv(SPLIT_PROGRAMS, rows * kv_heads)
    if max_run_keys is not None:
        wanted = max(wanted, triton.cdiv(slot_len, max_run_keys))
    return max(1, min(wanted, slot_len // MIN_CHUNK))


def attention_warps(block_d: int, splits: int) -> int:
    """Warps per decode-attention program (see NARROW_HEAD above)."""
    return NARROW_WARPS if block_d <= NARROW_HEAD and splits == 1 else ATTENTION_WARPS


NORM_STYLES = {"llama": 0, "gemma": 1, "olmo2": 2}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str = "llama") -> torch.Tensor:
    """layers.rms_norm in one kernel: x [N, H] -> [N, H] in x's dtype."""
    return _rms_norm(x, None, weight, eps, style)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 style: str = "llama") -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h), h) with h = residual + x, all [N, H], in one kernel (h rounded to x's dtype first)."""
    return _rms_norm(x, residual, weight, eps, style)


def _rms_norm(x, residual, weight, eps, style):
    N, H = x.shape
    assert x.stride(-1) == 1 and weight.is_contiguous() and (residual is None or residual.stride(-1) == 1)
    out = torch.empty_like(x)
    h = x if residual is None else torch.empty_like(x)
    r = x if residual is None else residual
    block = triton.next_power_of_2(H)
    _rms_norm_kernel[(N,)](x, r, h, weight, out, x.stride(0), r.stride(0), h.stride(0), out.stride(0), eps, H=H,
                           BLOCK=block, STYLE=NORM_STYLES[style], RESIDUAL=residual is not None,
                           num_warps=4 if block <= 2048 else 8)
    return out, h


def gated(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """[gate | up] [N, 2 I] -> layers.activation(gate, act) * up [N, I] in one kernel
    (act: silu | gelu_pytorch_tanh)."""
    N, width = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.stride(-1) == 1 and act in ("silu", "gelu_pytorch_tanh")
    out = torch.empty(N, width, dtype=gate_up.dtype, device=gate_up.device)
    block = min(GATED_BLOCK, triton.next_power_of_2(width))
    _gated_kernel[(N, triton.cdiv(width, block))](gate_up, out, gate_up.stride(0), out.stride(0), WIDTH=width,
                                                  BLOCK=block, GELU=act != "silu", num_warps=4)
    return out


def record(state, b: int, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
    """kv_pool.SlotState.record(b, tokens, logprobs) in one kernel instead of ~15 (the same state, changed alike)."""
    st = state
    assert st.out_tokens.stride() == st.out_logprobs.stride() and st.out_tokens.stride(-1) == 1
    block = 128
    _record_kernel[(triton.cdiv(b, block),)](
        tokens, logprobs, st.tokens, st.pos, st.n_gen, st.max_new, st.finished, st.out_tokens, st.out_logprobs,
        st.stop_ids, b, st.out_tokens.stride(0), st.max_new_tokens, STOPS=st.stop_ids.numel(), BLOCK=block,
        num_warps=4)
