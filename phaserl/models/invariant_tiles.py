"""Which tile a bitwise matmul call takes (invariant_triton.matmul and .matmul_group).

A row's bits must not depend on how many rows share its call. One tile for every call gives that by construction:
BASE. But BASE (64 x 64 outputs, 32-deep K steps, 3 stages) suits no call well: a decode step's call of 32 rows
spends its time waiting on memory (a 0.5B q projection, 896 x 896, is 14 programs each walking 28 K steps with two
loads in flight: 10.4 us a call where cuBLAS takes 4.1), and the training forward's thousands of rows want bigger
tiles with deeper K steps (a 1.5B gate/up projection at 8,192 rows: 1.79 ms, 0.79 with 128 x 128 x 64; cuBLAS
0.58). H100, 2026-12-06, weights read from device memory as a decode step reads them; BENCHMARKS.md.

What lets a call take another tile than BASE and keep the bits: on the GPU's tensor cores an output element is
its row's and column's products summed in 16-deep chunks, from the split's first column on, into one float32
accumulator, in order. Neither the tile's rows and columns nor how many chunks one K step holds (BLOCK_K), nor the
warps, the pipeline's stages or the instruction (Hopper's wgmma for 64-row tiles, mma.sync for 16) change that
order, so every tile gives the same float32 sums. Measured on an H100: all 14 tiles tried gave BASE's bits at every
0.5B and 1.5B projection at 1-256 rows (tests/test_invariant_tiles.py checks it on the GPU at Qwen2 shapes).
That is a property of the hardware and of Triton's code generation, not a promise: invariant_triton.agrees() checks
it once per device, dtype and tile on a ragged problem (a short K and a deep one in splits that end inside a K step)
and a call takes a tile of CANDIDATES only where the float32 sums are BASE's bit for bit; elsewhere (another GPU, a
compiler that orders the chunks otherwise, Triton's CPU interpreter, whose numpy dot sums a whole K step at once)
every call takes BASE: the speed of one fixed tile and the same guarantee.
"""
from __future__ import annotations

from typing import NamedTuple


class Tile(NamedTuple):
    """One matmul configuration: block_m x block_n outputs a program, block_k deep K steps, warps, pipeline stages.
    Triton launch options and constants only: the split-K layout (k_splits, in BLOCK_K = 32 units) is the
    weight's and the same for every tile."""
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


BASE = Tile(64, 64, 32, 4, 3)
# Calls of few rows (a decode step's: memory-bound) take tiles with more programs and deeper loads in flight; which
# by the call's rows (up to FEW_ROWS, up to SOME_ROWS) and its weights: narrow (at most NARROW_COLS output columns
# and one K split: q, k/v, o, q/k/v in one launch) or not (gate/up, the vocabulary head, the split down projections).
# H100, weights read from device memory, 2026-12-06, `benchmarks/invariant_kernels.py --tiles`, us a call at 32 / 256
# rows, BASE -> this tile (cuBLAS):
#   0.5B q 10.7 -> 4.0 (4.4) / 10.9 -> 4.4 (4.9); o 10.7 -> 3.9 / 10.8 -> 4.3; gate/up 13.8 -> 9.3 (8.8) / 17.9 -> 16.6
#   (11.3); down 10.7 -> 8.0 (8.6) / 14.3 -> 13.7 (10.0); 1.5B q 17.4 -> 5.4 (5.6) / 17.6 -> 7.6 (6.2); gate/up 29.5
#   -> 27.2 (24.4) / 62.8 -> 48.0 (26.5); down 24.3 -> 16.1 (14.8) / 32.4 -> 33.9 (18.4). Every tile tried gave BASE's
#   bits (rows 1-256). The wide tiles trade: 64 x 64 x 64 with 3 stages was 23.6 on 1.5B gate/up but 10.3 on 0.5B's.
# More rows (prefill, the training forward, the vocabulary head's 1,024-token chunks): compute-bound, so bigger tiles
# with 64-deep K steps. H100, 2026-12-06, us a call at 512 / 2,048 / 8,192 rows, BASE -> this tile (cuBLAS):
#   MANY (narrow or split weights): 0.5B q 10.7 -> 7.3 (4.6) / 14.7 -> 10.3 (8.0) / 53.1 -> 35.7 (24.3); 0.5B down
#   24.9 -> 24.1 (10.8) / 73.6 -> 50.1 (27.6) / 336 -> 208 (100); 1.5B q 17.9 -> 10.5 (7.9) / 40.2 -> 27.6 (15.2) /
#   156 -> 87 (54); 1.5B down 106 -> 54 (31) / 275 -> 178 (71) / 1085 -> 664 (275).
#   MANY_WIDE (wider one-split weights): 0.5B gate/up 39.2 -> 23.7 (16.3) / 132 -> 71 (55) / 524 -> 278 (200); 1.5B
#   gate/up 112 -> 60 (46) / 421 -> 199 (153) / 1794 -> 789 (580).
#   128 x 128 tiles lose on the split down projections (0.5B at 2,048 rows 1.17x BASE) and on k/v (128-256 columns).
#   Every one of 16 tiles gave BASE's bits at 512-8,192 rows.
FEW_ROWS, SOME_ROWS = 64, 256
NARROW_COLS = 2048
FEW_NARROW, FEW_WIDE = Tile(16, 32, 128, 4, 5), Tile(64, 64, 64, 4, 5)
SOME_NARROW, SOME_WIDE = Tile(64, 32, 128, 4, 4), Tile(64, 64, 64, 4, 3)
MANY, MANY_WIDE = Tile(64, 128, 64, 4, 4), Tile(128, 128, 64, 8, 3)
CANDIDATES = (FEW_NARROW, FEW_WIDE, SOME_NARROW, SOME_WIDE, MANY, MANY_WIDE)


def candidate(rows: int, cols: int, splits: int = 1) -> Tile:
    """The tile a call of `rows` rows, `cols` output columns and `splits` K splits takes if that tile agrees with
    BASE on this device."""
    narrow = cols <= NARROW_COLS and splits == 1
    if rows <= FEW_ROWS:
        return FEW_NARROW if narrow else FEW_WIDE
    if rows <= SOME_ROWS:
        return SOME_NARROW if narrow else SOME_WIDE
    return MANY_WIDE if cols > NARROW_COLS and splits == 1 else MANY
