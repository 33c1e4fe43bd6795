"""The bitwise mode's split-K matmul (models/invariant_triton.py): the number of K splits is a function of the
weight's shape alone (only deep weights split), so a row's bits do not depend on how many rows share the call, where
the row sits, or whether the launch spreads the splits over programs (a float32 workspace summed in split order) or
adds them inside one program per tile. The kernel checks force a small weight to split and run in Triton's CPU
interpreter (in a fresh process: Triton reads TRITON_INTERPRET once) in float32 and float16 (the interpreter's
bfloat16 dot is not usable); @pytest.mark.gpu runs the same checks in bfloat16 on CUDA, on a down projection's shape
at the product's rule, and the engine-vs-trainer equality with every projection split.
"""
import contextlib
import importlib.util
import os

import pytest
import torch

from _interpreted import bits as _as_bits
from _interpreted import run_interpreted
from _interpreted import triton_constants as _constants
from phaserl.models import invariant, invariant_triton


@pytest.mark.parametrize("K, M, expected", [
    (4864, 896, (10, 512)),      # Qwen2-0.5B down (K = 5.4 M): 14 column tiles x 10 splits of 16 BLOCK_K steps
    (8960, 1536, (6, 1504)),     # 1.5B down: 24 x 6 = 144 programs, 47 steps a split
    (18944, 3584, (3, 6336)),    # 7B down: 56 x 3
    (14336, 4096, (3, 4800)),    # Llama-3 8B down (K = 3.5 M): 64 x 3
    (4096, 2048, (5, 832)),      # on both bounds (K = 2 M = 4096): 32 x 5
    (4096, 2049, (1, 4096)),     # K just under 2 M: one split
    (4064, 1024, (1, 4064)),     # K = 4 M but under the 4096 floor: one split
    (896, 128, (1, 896)),        # 0.5B k/v (K = 7 M, 28 steps): under the floor
    (3584, 512, (1, 3584)),      # 7B k/v: under the floor
    (896, 896, (1, 896)),        # 0.5B q/o (K = M)
    (896, 4864, (1, 896)),       # 0.5B gate/up
    (896, 151936, (1, 896)),     # the vocabulary head
    (32, 48, (1, 32)),           # a tiny model's depth
])
def test_only_deep_weights_split_and_the_splits_are_a_function_of_the_weights_shape(K, M, expected):
    """Hand-worked: a weight splits only when K >= 2 M and K >= 4096; then S = min(cdiv(132, cdiv(M, 64)),
    cdiv(K, 32) // 4) and each split covers cdiv(cdiv(K, 32), S) steps of 32."""
    assert invariant_triton.k_splits(K, M) == expected


def test_forced_splits_of_a_short_weight_are_capped_by_the_splits_depth(monkeypatch):
    """The interpreter's weight below (K = 500: 16 steps) split by lowering the floor: 4 splits of 4 steps, the last
    split 116 deep (a partial BLOCK_K step)."""
    monkeypatch.setattr(invariant_triton, "DEEP_MIN_K", 0)
    assert invariant_triton.k_splits(500, 80) == (4, 128)


def test_without_split_k_every_weight_takes_one_split(monkeypatch):
    monkeypatch.setattr(invariant_triton, "SPLIT_K", False)
    assert invariant_triton.k_splits(4864, 896) == (1, 4864)


def test_an_unknown_launch_is_an_error_naming_the_choices():
    with pytest.raises(ValueError, match="splits"):
        invariant_triton.matmul(torch.ones(2, 4), torch.ones(3, 4), launch="split")


def check_rows_and_launches(device: str, dtypes, K: int = 500, M: int = 80, N: int = 200, force: bool = True) -> None:
    """A row's bits are the same alone, in batches of 3, 17, 64 and 200 rows, at several row offsets, with either
    launch; the result is torch's within rounding; and one split (SPLIT_K = False) gives other bits, so the
    comparisons above can fail. force: split the weight even under the product's depth floor (K = 500 is short)."""
    with _constants(DEEP_MIN_K=0) if force else contextlib.nullcontext():
        _check_rows_and_launches(device, dtypes, K, M, N)


def _check_rows_and_launches(device: str, dtypes, K: int, M: int, N: int) -> None:
    g = torch.Generator(device=device).manual_seed(0)
    for dtype in dtypes:
        x = torch.randn(N, K, generator=g, device=device).to(dtype)  # [N, K]
        w = torch.randn(M, K, generator=g, device=device).to(dtype)  # [M, K]
        b = torch.randn(M, generator=g, device=device).to(dtype)
        assert invariant_triton.k_splits(K, M)[0] > 1
        for bias, out_dtype in ((None, torch.float32), (b, dtype)):
            whole = _as_bits(invariant_triton.matmul(x, w, bias, out_dtype, launch="tiles"))  # [N, M]
            for launch in ("splits", "auto"):
                assert torch.equal(_as_bits(invariant_triton.matmul(x, w, bias, out_dtype, launch=launch)), whole)
            for rows in (1, 3, 17, 64, N):
                for start in sorted({0, 5, 63, N - rows}):
                    if start + rows <= N:
                        part = invariant_triton.matmul(x[start:start + rows], w, bias, out_dtype, launch="splits")
                        assert torch.equal(_as_bits(part), whole[start:start + rows]), (dtype, rows, start)
        exact = invariant_triton.matmul(x, w)  # [N, M] float32
        torch.testing.assert_close(exact, x.float() @ w.float().T, rtol=1e-4, atol=1e-3)
        with _constants(SPLIT_K=False):
            one = invariant_triton.matmul(x, w)
        assert not torch.equal(_as_bits(one), _as_bits(exact)), dtype  # the split order shows in the bits


INTERPRETED = f"""
import sys
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import torch
from test_invariant_splitk import check_rows_and_launches
check_rows_and_launches("cpu", (torch.float32, torch.float16))
"""


@pytest.mark.slow  # a fresh interpreter that imports torch and Triton, then ~100 interpreted launches
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its CPU interpreter)")
def test_split_k_rows_are_batch_invariant_in_the_interpreter():
    run_interpreted(INTERPRETED)


def _needs_cuda_triton():
    if not torch.cuda.is_available() or not invariant_triton.available(torch.device("cuda")):
        pytest.skip("needs Triton on CUDA")


@pytest.mark.gpu
def test_gpu_split_k_rows_are_batch_invariant():
    _needs_cuda_triton()
    check_rows_and_launches("cuda", (torch.bfloat16, torch.float16, torch.float32))
    check_rows_and_launches("cuda", (torch.bfloat16,), K=4864, M=896, N=300, force=False)  # 0.5B down: deep


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2", "gemma3-local-global"])
def test_gpu_trainer_logprobs_equal_the_engines_with_every_projection_split(family, monkeypatch):
    """The tiny models' weights (32 and 48 deep) take one split at the product's constants; no depth rule, 16-deep
    steps and one step a split split every projection, so decode, prefill and the packed training forward all cross
    the split-K path."""
    _needs_cuda_triton()
    from test_bitwise import _families, _model, _trainer_vs_engine

    for name, value in (("DEEP_RATIO", 0), ("DEEP_MIN_K", 0), ("BLOCK_K", 16), ("MIN_SPLIT_STEPS", 1)):
        monkeypatch.setattr(invariant_triton, name, value)
    assert invariant_triton.k_splits(48, 32)[0] == 3
    model = _model(_families()[family], dtype=torch.bfloat16, device="cuda")
    try:
        assert max(_trainer_vs_engine(model, device="cuda")) == 0.0
    finally:
        invariant.enable(False)
