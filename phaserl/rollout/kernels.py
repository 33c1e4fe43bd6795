"""Triton kernels for the decode step: attention over each row's used context, and one-pass sampling.

  decode_attention  one query token per row against its slot's cached keys/values [0, pos) (a sliding
                    layer's: the window before pos), plus the row's own new key/value, which the
                    kernel also writes into the cache at `pos`.
                    Reads K/V only up to each row's length (the torch fallback reads the whole slot),
                    online softmax in float32, grouped-query heads share each K/V load.
  sample            per row, one pass over the logits: max and log-sum-exp (online), and a draw from
                    softmax(z / T) by two-level Gumbel-max (a vocabulary block by its mass, then a token
                    in that block, re-read), with noise from Philox keyed by a device-side seed; greedy =
                    argmax z. Returns the token and its log-prob under log_softmax(z / T), like
                    runner.sample_tokens.
Both run inside CUDA graphs (no host sync; the seed lives in a device tensor that the caller advances).
The pure-torch versions of the same math live in runner.py and are used on the CPU and without Triton.
Not here: top-k / top-p filtering (the torch path does it), prefill attention (SDPA).

Legend: b rows, Hq/Hkv heads, G = Hq / Hkv, D head_dim, S slot_len, V vocab.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter: how the kernels are tested here
# Launch settings. Sampling's were swept on an H200 at the reference shape (BENCHMARKS.md); attention's are
# a first guess (`benchmarks/rollout.py --case ours --profile --sweep` times the options inside CUDA graphs).
ATTENTION_BLOCK_N, ATTENTION_WARPS, ATTENTION_STAGES = 64, 4, 3
SAMPLE_BLOCK, SAMPLE_WARPS = 4096, 8

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _attend_block(q, k_ptr, v_ptr, cache, start, lo, pos, c_ss, d, d_ok, scale, m, total, acc,
                      BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        """Online-softmax update of (m, total, acc) with cached keys [start, start + BLOCK_N) in [lo, pos)."""
        keys_at = start + tl.arange(0, BLOCK_N)
        k_ok = (keys_at < pos) & (keys_at >= lo)
        offsets = cache + keys_at[:, None] * c_ss + d[None, :]
        k = tl.load(k_ptr + offsets, mask=k_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_ptr + offsets, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:  # float32 models: full precision, as the torch path computes
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # [BLOCK_G, BLOCK_N] float32
        s = tl.where(k_ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, total, acc

    @triton.jit
    def _decode_attention_kernel(q_ptr, kn_ptr, vn_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, scale, window,
                                 q_sb, q_sh, kn_sb, kn_sh, vn_sb, vn_sh, c_sb, c_sh, c_ss, o_sb, o_sh,
                                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                                 BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                                 PER_ROW_BOUND: tl.constexpr, SLOT_LEN: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        pos = tl.load(pos_ptr + row)  # this row's new token sits at `pos`; keys [0, pos) are cached
        lo = tl.maximum(pos - window + 1, 0)  # the first key a sliding layer sees (window >= slot_len: 0)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        g_ok, d_ok = g < GROUP, d < HEAD_DIM
        heads = kv_head * GROUP + g
        q = tl.load(q_ptr + row * q_sb + heads[:, None] * q_sh + d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                    other=0.0)  # [BLOCK_G, BLOCK_D]
        k_new = tl.load(kn_ptr + row * kn_sb + kv_head * kn_sh + d, mask=d_ok, other=0.0)  # [BLOCK_D]
        v_new = tl.load(vn_ptr + row * vn_sb + kv_head * vn_sh + d, mask=d_ok, other=0.0)
        cache = row * c_sb + kv_head * c_sh
        tl.store(k_ptr + cache + pos * c_ss + d, k_new, mask=d_ok)
        tl.store(v_ptr + cache + pos * c_ss + d, v_new, mask=d_ok)
        # The row's own key first: always visible, so the running max starts finite.
        m = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale  # [BLOCK_G]
        total = tl.full([BLOCK_G], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32) + v_new.to(tl.float32)[None, :]
        if PER_ROW_BOUND:
            for start in range((lo // BLOCK_N) * BLOCK_N, pos, BLOCK_N):
                m, total, acc = _attend_block(q, k_ptr, v_ptr, cache, start, lo, pos, c_ss, d, d_ok, scale, m, total,
                                              acc, BLOCK_N, IEEE)
        else:  # the interpreter cannot loop to a loaded bound; masked lanes load nothing either way
            for start in range(0, SLOT_LEN, BLOCK_N):
                m, total, acc = _attend_block(q, k_ptr, v_ptr, cache, start, lo, pos, c_ss, d, d_ok, scale, m, total,
                                              acc, BLOCK_N, IEEE)
        out = acc / total[:, None]
        tl.store(out_ptr + row * o_sb + heads[:, None] * o_sh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _sample_kernel(logits_ptr, stride, seed_ptr, tokens_ptr, logprobs_ptr, temperature,
                       VOCAB: tl.constexpr, GREEDY: tl.constexpr, BLOCK: tl.constexpr, BLOCKS_POW2: tl.constexpr):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * stride
        seed = tl.load(seed_ptr)
        lanes = tl.arange(0, BLOCK)
        blocks = tl.arange(0, BLOCKS_POW2)
        # Two-level Gumbel-max: pick a vocabulary block with probability (its mass) / (all mass), then a
        # token inside it with probability exp(z) / (block mass); the product is softmax(z). Noise for
        # one key per block and for one block's tokens, not for all V (Philox is the costly part).
        block_gumbel = -tl.log(-tl.log(tl.rand(seed, (1 << 30) + row * BLOCKS_POW2 + blocks)))  # [BLOCKS_POW2]
        zero = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)  # loop-carried scalars start as typed tensors
        m = zero - float("inf")  # running max of z
        total = zero             # running sum of exp(z - m)
        best = zero - float("inf")
        best_start = tl.sum(tl.zeros([BLOCK], tl.int32), axis=0)
        for start in range(0, VOCAB, BLOCK):
            cols = start + lanes
            z = tl.load(base + cols, mask=cols < VOCAB, other=float("-inf")).to(tl.float32) / temperature  # [BLOCK]
            block_max = tl.max(z, axis=0)
            block_sum = tl.sum(tl.exp(z - block_max), axis=0)  # >= 1
            m_new = tl.maximum(m, block_max)
            total = total * tl.exp(m - m_new) + block_sum * tl.exp(block_max - m_new)
            m = m_new
            if GREEDY:  # the block holding the first maximum
                key = block_max
            else:
                key = block_max + tl.log(block_sum) + tl.sum(tl.where(blocks == start // BLOCK, block_gumbel, 0.0))
            better = key > best  # strict: the first maximum wins, as torch.argmax
            best = tl.where(better, key, best)
            best_start = tl.where(better, start, best_start)
        cols = best_start + lanes
        ok = cols < VOCAB
        z = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32) / temperature
        if GREEDY:
            key = z
        else:  # z - log(E), E = -log(U) ~ Exp(1); U = 0 gives -inf (never drawn)
            key = tl.where(ok, z - tl.log(-tl.log(tl.rand(seed, row * BLOCK + lanes))), float("-inf"))
        index = tl.argmax(key, axis=0)
        chosen_z = tl.sum(tl.where(lanes == index, z, 0.0), axis=0)
        tl.store(tokens_ptr + row, (best_start + index).to(tl.int64))
        tl.store(logprobs_ptr + row, chosen_z - m - tl.log(total))


def available(device: torch.device) -> bool:
    """The kernels run on CUDA when Triton is installed (and on the CPU under TRITON_INTERPRET=1)."""
    return HAVE_TRITON and (device.type == "cuda" or INTERPRET)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     pos: torch.Tensor, scale: Optional[float] = None, window: Optional[int] = None, *,
                     block_n: Optional[int] = None, num_warps: Optional[int] = None,
                     num_stages: Optional[int] = None) -> torch.Tensor:
    """q [b, Hq, D], the new k/v [b, Hkv, D], cache keys/values [slots >= b, Hkv, S, D], pos [b] -> [b, Hq * D].

    Writes k/v into the cache at (row, :, pos[row]) and attends over cache positions [0, pos] of each row, or
    [pos - window + 1, pos] for a sliding layer. scale: of the scores (None: D ** -0.5).
    """
    b, Hq, D = q.shape
    Hkv = keys.shape[1]
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == keys.stride(-1) == values.stride(-1) == 1
    assert keys.stride() == values.stride()
    out = torch.empty(b, Hq, D, dtype=q.dtype, device=q.device)
    G = Hq // Hkv
    # Key/value tiles of BLOCK_N x BLOCK_D, pipelined in num_stages copies, must fit in shared memory: head_dim
    # 512 (Gemma 4's global layers) takes half as many keys per block as head_dim <= 256.
    block_d = max(16, triton.next_power_of_2(D))
    _decode_attention_kernel[(b, Hkv)](
        q, k, v, keys, values, pos, out, D ** -0.5 if scale is None else scale,
        keys.shape[2] + 1 if window is None else int(window),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), out.stride(0), out.stride(1),
        GROUP=G, HEAD_DIM=D, BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_D=block_d,
        BLOCK_N=block_n or min(ATTENTION_BLOCK_N, 16384 // block_d), IEEE=q.dtype == torch.float32,
        PER_ROW_BOUND=not INTERPRET,
        SLOT_LEN=keys.shape[2] if INTERPRET else 0, num_warps=num_warps or ATTENTION_WARPS,
        num_stages=num_stages or ATTENTION_STAGES)
    return out.view(b, Hq * D)


def sample(logits: torch.Tensor, seed: torch.Tensor, greedy: bool, temperature: float) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
    """logits [b, V] -> (tokens [b] int64, logprobs [b] float32 under log_softmax(logits / T)).

    seed: int64 [1] on the device; the same seed and logits give the same draws (advance it between calls).
    """
    b, V = logits.shape
    assert logits.stride(-1) == 1
    tokens = torch.empty(b, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(b, dtype=torch.float32, device=logits.device)
    block = min(SAMPLE_BLOCK, triton.next_power_of_2(V))
    _sample_kernel[(b,)](logits, logits.stride(0), seed, tokens, logprobs, 1.0 if greedy else float(temperature),
                         VOCAB=V, GREEDY=greedy, BLOCK=block, BLOCKS_POW2=triton.next_power_of_2(triton.cdiv(V, block)),
                         num_warps=SAMPLE_WARPS)
    return tokens, logprobs
