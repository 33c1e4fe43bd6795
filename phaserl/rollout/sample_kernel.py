"""Triton kernels of the decode step's sampler: one pass over each row's logits, and the keyed noise of the
torch sampler (top-k / top-p) on CUDA.

  sample            per row, one pass over the logits: max and log-sum-exp (online), and a draw from
                    softmax(z / T) by two-level Gumbel-max (a vocabulary block by its mass, then a token
                    in that block, re-read), with noise from Philox keyed by the row's own seed, derived
                    in the kernel from (the call's seed, the row's sequence key, the position it draws
                    after) as sampling.row_states derives it; greedy = argmax z. Returns the token and its
                    log-prob under log_softmax(z / T), like torch_path.sample_tokens. With fewer rows than
                    SAMPLE_PROGRAMS, each row's blocks are split over programs and a second kernel merges
                    their statistics and best blocks (the block keys depend on the block index only, so
                    the draws do not change with the split).
  keyed_noise       Exp(1) noise [b, V] for torch_path.sample_tokens (top-k / top-p), Philox under the same
                    per-row seeds: the CUDA twin of sampling.keyed_noise (other numbers, the same law).
Both run inside CUDA graphs (no host sync; the seed, keys and positions live in device tensors).
tests/test_rollout_engine.py and tests/test_rollout_noise.py compare them with their torch twins (sampling.py).
Not here: top-k / top-p filtering (the torch path does it), the other decode kernels (kernels.py).
"""
from __future__ import annotations

import torch

from phaserl.rollout.kernels import HAVE_TRITON
from phaserl.rollout.sampling import MIX1, MIX2

SAMPLE_BLOCK, SAMPLE_WARPS = 4096, 8
SAMPLE_PROGRAMS = 2048  # the sampler splits each row's vocabulary until about this many programs run

if HAVE_TRITON:
    import triton
    import triton.language as tl

    _MIX1, _MIX2 = tl.constexpr(MIX1), tl.constexpr(MIX2)

    @triton.jit
    def _mix64(x):
        """sampling.mix64 on an int64 scalar: >> is arithmetic here too, so the masks make it logical."""
        x = (x ^ ((x >> 30) & 0x3FFFFFFFF)) * _MIX1
        x = (x ^ ((x >> 27) & 0x1FFFFFFFFF)) * _MIX2
        return x ^ ((x >> 31) & 0x1FFFFFFFF)

    @triton.jit
    def _row_seed(seed_ptr, key_ptr, at_ptr, row):
        """The row's Philox seed: sampling.row_states(seed, key[row], at[row]), a few scalar loads and int ops."""
        return _mix64(_mix64(_mix64(tl.load(seed_ptr)) + tl.load(key_ptr + row)) + tl.load(at_ptr + row))

    @triton.jit
    def _noise_kernel(seed_ptr, key_ptr, at_ptr, out_ptr, o_sb, VOCAB: tl.constexpr, BLOCK: tl.constexpr):
        """Program (row, block): E = -log(U), U ~ Uniform[0, 1) from Philox under the row's seed (U = 0: E = inf,
        a token that is never drawn)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        seed = _row_seed(seed_ptr, key_ptr, at_ptr, row)
        tl.store(out_ptr + row * o_sb + cols, -tl.log(tl.rand(seed, cols)), mask=cols < VOCAB)

    @triton.jit
    def _scan_blocks(base, seed, first_block, n_blocks, temperature, VOCAB: tl.constexpr, GREEDY: tl.constexpr,
                     BLOCK: tl.constexpr, SPAN_POW2: tl.constexpr):
        """Vocabulary blocks [first_block, first_block + n_blocks) of one row: (running max m of z, sum of exp(z - m),
        the best block key, that block's first column). A block's key is its max (greedy) or the log of its mass
        plus its Gumbel noise, keyed by the block's index, so any split of the blocks gives the same keys."""
        lanes = tl.arange(0, BLOCK)
        local = tl.arange(0, SPAN_POW2)
        # Two-level Gumbel-max: pick a vocabulary block with probability (its mass) / (all mass), then a
        # token inside it with probability exp(z) / (block mass); the product is softmax(z). Noise for
        # one key per block and for one block's tokens, not for all V (Philox is the costly part).
        block_gumbel = -tl.log(-tl.log(tl.rand(seed, (1 << 30) + first_block + local)))  # [SPAN_POW2]
        zero = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)  # loop-carried scalars start as typed tensors
        m = zero - float("inf")  # running max of z
        total = zero             # running sum of exp(z - m)
        best = zero - float("inf")
        best_start = tl.sum(tl.zeros([BLOCK], tl.int32), axis=0)
        for j in range(0, n_blocks):
            start = (first_block + j) * BLOCK
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
                key = block_max + tl.log(block_sum) + tl.sum(tl.where(local == j, block_gumbel, 0.0))
            better = key > best  # strict: the first maximum wins, as torch.argmax
            best = tl.where(better, key, best)
            best_start = tl.where(better, start, best_start)
        return m, total, best, best_start

    @triton.jit
    def _draw_in_block(base, seed, row, best_start, m, total, tokens_ptr, logprobs_ptr, temperature,
                       VOCAB: tl.constexpr, GREEDY: tl.constexpr, BLOCK: tl.constexpr):
        """The token inside the chosen block (Gumbel-max over its columns) and its log-prob under softmax(z)."""
        lanes = tl.arange(0, BLOCK)
        cols = best_start + lanes
        ok = cols < VOCAB
        z = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32) / temperature
        if GREEDY:
            key = z
        else:  # z - log(E), E = -log(U) ~ Exp(1); U = 0 gives -inf (never drawn)
            key = tl.where(ok, z - tl.log(-tl.log(tl.rand(seed, lanes))), float("-inf"))
        index = tl.argmax(key, axis=0)
        chosen_z = tl.sum(tl.where(lanes == index, z, 0.0), axis=0)
        tl.store(tokens_ptr + row, (best_start + index).to(tl.int64))
        tl.store(logprobs_ptr + row, chosen_z - m - tl.log(total))

    @triton.jit
    def _sample_kernel(logits_ptr, stride, seed_ptr, key_ptr, at_ptr, tokens_ptr, logprobs_ptr, temperature,
                       VOCAB: tl.constexpr, GREEDY: tl.constexpr, BLOCK: tl.constexpr, BLOCKS_POW2: tl.constexpr):
        """One program per row over all of its blocks."""
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * stride
        # Keyed noise: the row's draw depends on (seed, its sequence's key, its position), not on the row index
        # or the step, so a sequence samples alike in any slot and batch (rollout/sampling.py).
        seed = _row_seed(seed_ptr, key_ptr, at_ptr, row)
        m, total, best, best_start = _scan_blocks(base, seed, 0, tl.cdiv(VOCAB, BLOCK), temperature, VOCAB=VOCAB,
                                                  GREEDY=GREEDY, BLOCK=BLOCK, SPAN_POW2=BLOCKS_POW2)
        _draw_in_block(base, seed, row, best_start, m, total, tokens_ptr, logprobs_ptr, temperature, VOCAB=VOCAB,
                       GREEDY=GREEDY, BLOCK=BLOCK)

    @triton.jit
    def _sample_split_kernel(logits_ptr, stride, seed_ptr, key_ptr, at_ptr, part_ptr, start_ptr, temperature,
                             VOCAB: tl.constexpr, GREEDY: tl.constexpr, BLOCK: tl.constexpr, SPAN: tl.constexpr,
                             SPAN_POW2: tl.constexpr, SPLITS: tl.constexpr):
        """Program (row, split): `_scan_blocks` over the split's SPAN blocks; its (m, total, best key) go to
        part [row, split, 3] and the best block's first column to start [row, split]."""
        row, split = tl.program_id(0), tl.program_id(1)
        base = logits_ptr + row.to(tl.int64) * stride
        seed = _row_seed(seed_ptr, key_ptr, at_ptr, row)
        first = split * SPAN
        n_blocks = tl.minimum(SPAN, tl.cdiv(VOCAB, BLOCK) - first)
        m, total, best, best_start = _scan_blocks(base, seed, first, n_blocks, temperature, VOCAB=VOCAB,
                                                  GREEDY=GREEDY, BLOCK=BLOCK, SPAN_POW2=SPAN_POW2)
        out = part_ptr + (row * SPLITS + split) * 3
        tl.store(out, m)
        tl.store(out + 1, total)
        tl.store(out + 2, best)
        tl.store(start_ptr + row * SPLITS + split, best_start)

    @triton.jit
    def _sample_merge_kernel(logits_ptr, stride, seed_ptr, key_ptr, at_ptr, part_ptr, start_ptr, tokens_ptr,
                             logprobs_ptr, temperature, VOCAB: tl.constexpr, GREEDY: tl.constexpr, BLOCK: tl.constexpr,
                             SPLITS: tl.constexpr, SPLITS_POW2: tl.constexpr):
        """One program per row: the splits' softmax statistics merged, the best block over all splits (the first
        on ties, as the one-program scan), then the draw inside it."""
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * stride
        seed = _row_seed(seed_ptr, key_ptr, at_ptr, row)
        s = tl.arange(0, SPLITS_POW2)
        ok = s < SPLITS
        at = part_ptr + (row * SPLITS + s) * 3
        m_s = tl.load(at, mask=ok, other=float("-inf"))
        total_s = tl.load(at + 1, mask=ok, other=0.0)
        best_s = tl.load(at + 2, mask=ok, other=float("-inf"))
        m = tl.max(m_s, axis=0)
        total = tl.sum(tl.where(ok, total_s * tl.exp(m_s - m), 0.0), axis=0)
        winner = tl.argmax(best_s, axis=0)  # the first maximum: the lowest split, so the lowest block
        best_start = tl.sum(tl.where(s == winner, tl.load(start_ptr + row * SPLITS + s, mask=ok, other=0), 0), axis=0)
        _draw_in_block(base, seed, row, best_start, m, total, tokens_ptr, logprobs_ptr, temperature, VOCAB=VOCAB,
                       GREEDY=GREEDY, BLOCK=BLOCK)


def sample_splits(rows: int, blocks: int) -> int:
    """Programs per row of the sampler: enough for SAMPLE_PROGRAMS in all (each row's vocabulary blocks split into
    that many runs, merged by a second launch), one when the rows alone are that many."""
    return max(1, min(blocks, triton.cdiv(SAMPLE_PROGRAMS, max(rows, 1))))


def sample(logits: torch.Tensor, seed: torch.Tensor, keys: torch.Tensor, at: torch.Tensor, greedy: bool,
           temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [b, V] -> (tokens [b] int64, logprobs [b] float32 under log_softmax(logits / T)).

    seed: int64 [1] on the device; keys, at: int64 [b], row i's sequence key and the position it draws after.
    Row i's draw is a function of (seed, keys[i], at[i], logits[i]) alone: equal triples give equal draws, however
    the row's vocabulary is split over programs (sample_splits).
    """
    b, V = logits.shape
    assert logits.stride(-1) == 1 and keys.is_contiguous() and at.is_contiguous()
    assert keys.dtype == at.dtype == seed.dtype == torch.long
    tokens = torch.empty(b, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(b, dtype=torch.float32, device=logits.device)
    block = min(SAMPLE_BLOCK, triton.next_power_of_2(V))
    blocks = triton.cdiv(V, block)
    temperature = 1.0 if greedy else float(temperature)
    splits = sample_splits(b, blocks)
    if splits == 1:
        _sample_kernel[(b,)](logits, logits.stride(0), seed, keys, at, tokens, logprobs, temperature,
                             VOCAB=V, GREEDY=greedy, BLOCK=block, BLOCKS_POW2=triton.next_power_of_2(blocks),
                             num_warps=SAMPLE_WARPS)
        return tokens, logprobs
    span = triton.cdiv(blocks, splits)
    splits = triton.cdiv(blocks, span)  # no empty split
    part = torch.empty(b, splits, 3, dtype=torch.float32, device=logits.device)  # m, total, best key
    starts = torch.empty(b, splits, dtype=torch.int32, device=logits.device)
    _sample_split_kernel[(b, splits)](logits, logits.stride(0), seed, keys, at, part, starts, temperature,
                                      VOCAB=V, GREEDY=greedy, BLOCK=block, SPAN=span,
                                      SPAN_POW2=triton.next_power_of_2(span), SPLITS=splits, num_warps=SAMPLE_WARPS)
    _sample_merge_kernel[(b,)](logits, logits.stride(0), seed, keys, at, part, starts, tokens, logprobs, temperature,
                               VOCAB=V, GREEDY=greedy, BLOCK=block, SPLITS=splits,
                               SPLITS_POW2=triton.next_power_of_2(splits), num_warps=SAMPLE_WARPS)
    return tokens, logprobs


def keyed_noise(seed: torch.Tensor, keys: torch.Tensor, at: torch.Tensor, vocab: int) -> torch.Tensor:
    """sampling.keyed_noise's contract in one kernel: Exp(1) [b, V] float32, row i a function of (seed, keys[i],
    at[i]) alone (Philox numbers, not splitmix64's: the two paths draw other noise from the same law)."""
    b = keys.shape[0]
    keys, at = keys.contiguous(), at.contiguous()
    out = torch.empty(b, vocab, dtype=torch.float32, device=keys.device)
    block = min(SAMPLE_BLOCK, triton.next_power_of_2(vocab))
    _noise_kernel[(b, triton.cdiv(vocab, block))](seed, keys, at, out, out.stride(0), VOCAB=vocab, BLOCK=block,
                                                   num_warps=4)
    return out
