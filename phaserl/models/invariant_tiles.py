"""Which tile a bitwise matmul call takes (invariant_triton.matmul and .matmul_group).

A row's bits must not depend on how many rows share its call. One tile for every call gives that by construction:
BASE. But BASE (64 x 64 outputs, 32-deep K steps, 3 stages) suits the training forward's thousands of rows, and a
decode step's call of 32 rows spends its time waiting on memory: a 0.5B q projection (896 x 896) is 14 programs
each walking 28 K steps with two loads in flight, 10.4 us a call where cuBLAS takes 4.1 (H100, 2026-12-06,
weights read from device memory as a decode step reads them; BENCHMARKS.md).

What lets a call of few rows take another tile and keep the bits: on the GPU's tensor cores an output element is
its row's and column's products summed in 16-deep chunks, from the split's first column on, into one float32
accumulator, in order. Neither the tile's rows and columns nor how many chunks one K step holds (BLOCK_K), nor the
warps, the pipeline's stages or the instruction (Hopper's wgmma for 64-row tiles, mma.sync for 16) change that
order, so every tile gives the same float32 sums. Measured on an H100: all 14 tiles tried gave BASE's bits at every
0.5B projection (tests/test_invariant_tiles.py checks it on the GPU at Qwen2 shapes). That is a property of the
hardware and of Triton's code generation, not a promise: invariant_triton.agrees() checks it once per device, dtype
and tile on a ragged problem (a short K and a deep one in splits that end inside a K step) and a call takes a
tile of CANDIDATES only where the float32 sums are BASE's bit for bit; elsewhere (another GPU, a compiler that
orders the chunks otherwise, Triton's CPU interpreter, whose numpy dot sums a whole K step at once) every call
takes BASE, the speed of one fixed tile and the same guarantee.

Legend: N rows of the call, M its output columns (the weights' total in a group launch).
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
# Few rows (a decode step's call, at most FEW_ROWS): memory-bound, so more programs and deeper loads in flight.
# H100, 0.5B, 32 rows, weights from device memory (us a call; BASE / this tile / cuBLAS):
#   NARROW  q 10.43 / 4.02 / 4.12, o + residual 10.81 / 4.03 / 5.64, q/k/v in one launch 11.70 / 4.05 / 12.04
#   WIDE    gate/up in one launch 14.84 / 10.34 / 11.55
FEW_ROWS = 64
NARROW = Tile(16, 32, 128, 4, 5)   # ... M <= NARROW_COLS: q/k/v/o and down projections
WIDE = Tile(64, 128, 64, 4, 4)     # ... wider: gate/up, the vocabulary head
NARROW_COLS = 2048
CANDIDATES = (NARROW, WIDE)


def candidate(rows: int, cols: int) -> Tile:
    """The tile a call of `rows` rows and `cols` output columns takes if it agrees with BASE on this device."""
    if rows > FEW_ROWS:
        return BASE
    return NARROW if cols <= NARROW_COLS else WIDE
