"""The bitwise matmul's tiles (models/invariant_tiles.py): a call of few rows takes a tile of its own only where that
tile's float32 sums are BASE's on the device (invariant_triton.agrees), so the row's bits never depend on the call.
In Triton's CPU interpreter the candidates do not agree (its dot sums a whole K step at once, in numpy's order): the
check sees it and every call takes BASE; with the check's answer forced, a few-row call's bits would differ, which is
what the check is for. @pytest.mark.gpu: on the GPU every candidate agrees in every dtype, and calls of 1-1,024 rows
at Qwen2 0.5B shapes (taking the candidates) equal the rows of one big call on BASE bit for bit.
"""
import importlib.util
import os

import pytest
import torch

from _interpreted import bits as _as_bits
from _interpreted import run_interpreted
from phaserl.models import invariant_tiles
from phaserl.models.invariant_tiles import (
    BASE,
    FEW_NARROW,
    FEW_WIDE,
    MANY,
    MANY_WIDE,
    SOME_NARROW,
    SOME_WIDE,
    candidate,
)


@pytest.mark.parametrize("rows, cols, splits, tile", [
    (1, 896, 1, FEW_NARROW), (32, 1152, 1, FEW_NARROW), (64, 2048, 1, FEW_NARROW),  # q/k/v/o at decode
    (32, 9728, 1, FEW_WIDE), (8, 151936, 1, FEW_WIDE), (32, 896, 10, FEW_WIDE),     # gate/up, vocabulary, down
    (65, 896, 1, SOME_NARROW), (256, 1152, 1, SOME_NARROW),                         # a larger decode batch
    (128, 9728, 1, SOME_WIDE), (256, 896, 10, SOME_WIDE),
    (257, 896, 1, MANY), (4096, 1152, 1, MANY), (4096, 896, 10, MANY),             # prefill, the training forward
    (257, 9728, 1, MANY_WIDE), (8192, 9728, 1, MANY_WIDE), (1024, 151936, 1, MANY_WIDE),
])
def test_the_candidate_is_a_function_of_the_calls_rows_columns_and_splits(rows, cols, splits, tile):
    assert candidate(rows, cols, splits) == tile


def test_every_candidate_differs_from_base_and_keeps_the_split_layouts_unit():
    """A candidate equal to BASE would make the check vacuous; the K splits are cut in 32-deep units for every
    tile, which every candidate's K step must divide or be divided by (the check's splits end inside a step)."""
    for tile in invariant_tiles.CANDIDATES:
        assert tile != BASE
        assert tile.block_k % BASE.block_k == 0 or BASE.block_k % tile.block_k == 0, tile


def check_base_everywhere_in_the_interpreter() -> None:
    from phaserl.models import invariant_triton as it

    cpu, f32 = torch.device("cpu"), torch.float32
    assert not any(it.agrees(tile, cpu, f32) for tile in invariant_tiles.CANDIDATES)
    assert it.tile_for(32, 896, cpu, f32) == BASE and it.tile_for(128, 9728, cpu, f32) == BASE
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(150, 1008, generator=g), torch.randn(96, 1008, generator=g)
    whole = _as_bits(it.matmul(x, w))
    for rows, start in ((1, 0), (32, 7), (64, 80)):
        assert torch.equal(_as_bits(it.matmul(x[start:start + rows], w)), whole[start:start + rows]), (rows, start)
    it._AGREES[(FEW_NARROW, cpu, f32)] = True  # the check's answer forced: the few-row call takes its tile ...
    assert it.tile_for(32, 96, cpu, f32) == FEW_NARROW
    assert not torch.equal(_as_bits(it.matmul(x[:32], w)), whole[:32])  # ... and its bits are not the big call's


INTERPRETED = f"""
import sys
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
from test_invariant_tiles import check_base_everywhere_in_the_interpreter
check_base_everywhere_in_the_interpreter()
"""


@pytest.mark.slow  # a fresh interpreter that imports torch and Triton, then ~30 interpreted launches
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its CPU interpreter)")
def test_in_the_interpreter_the_check_refuses_the_candidates_and_every_call_takes_base():
    run_interpreted(INTERPRETED)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its error type)")
def test_a_tile_whose_launch_does_not_fit_the_gpu_falls_back_to_base_once(monkeypatch):
    """A chosen tile whose compiled kernel wants more shared memory than the GPU has (a float32 group launch on an
    H100) runs as BASE instead, with one warning, and later calls of that kernel skip it; a tile the caller names
    (agrees' own check) gets the error."""
    from triton.runtime.errors import OutOfResources

    from phaserl.models import invariant_triton as it

    cpu, f32 = torch.device("cpu"), torch.float32
    monkeypatch.setattr(it, "_TOO_BIG", set())
    monkeypatch.setitem(it._AGREES, (SOME_NARROW, cpu, f32), True)
    tried = []

    def launch(tile):
        tried.append(tile)
        if tile != BASE:
            raise OutOfResources(294912, 232448, "shared memory")
        return "ran on BASE"

    tile = it.tile_for(70, 112, cpu, f32, kernel="group")
    assert tile == SOME_NARROW
    with pytest.warns(RuntimeWarning, match="does not fit this GPU"):
        assert it._fitting(launch, "group", tile, True, cpu, f32) == "ran on BASE"
    assert tried == [SOME_NARROW, BASE]
    assert it.tile_for(70, 112, cpu, f32, kernel="group") == BASE     # remembered for that kernel ...
    assert it.tile_for(70, 112, cpu, f32, kernel="matmul") == SOME_NARROW  # ... only
    with pytest.raises(OutOfResources):
        it._fitting(launch, "matmul", SOME_NARROW, False, cpu, f32)


def _cuda():
    from phaserl.models import invariant_triton as it

    if not torch.cuda.is_available() or not it.available(torch.device("cuda")):
        pytest.skip("needs Triton on CUDA")
    return it, torch.device("cuda", torch.cuda.current_device())


@pytest.mark.gpu
def test_gpu_every_candidate_sums_as_base_in_every_dtype():
    it, device = _cuda()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for tile in invariant_tiles.CANDIDATES:
            assert it.agrees(tile, device, dtype), (torch.cuda.get_device_name(), dtype, tile)


@pytest.mark.gpu
def test_gpu_calls_at_qwen2_shapes_equal_the_rows_of_one_big_call_on_base(monkeypatch):
    """0.5B: q with bias, o with a residual, q/k/v and gate/up as group launches, down in splits; rows 1-1,024 (every
    band's candidates) at two offsets, and the whole call on its own candidate, against a 1,200-row call on BASE."""
    it, device = _cuda()
    g = torch.Generator(device=device).manual_seed(0)
    H, D, inter, dtype = 896, 128, 4864, torch.bfloat16

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    R = 1200
    x, xi = rand(R, H), rand(R, inter)
    wq, wk, wv, wo = rand(H, H, scale=H ** -0.5), rand(D, H, scale=H ** -0.5), rand(D, H, scale=H ** -0.5), rand(
        H, H, scale=H ** -0.5)
    wg, wu, wd = rand(inter, H, scale=H ** -0.5), rand(inter, H, scale=H ** -0.5), rand(H, inter, scale=inter ** -0.5)
    bq, bk, bv, res = rand(H), rand(D), rand(D), rand(R, H)
    calls = {
        "q": lambda r: [it.matmul(x[r], wq, bq, dtype)],
        "o": lambda r: [it.matmul(x[r], wo, None, dtype, residual=res[r])],
        "qkv": lambda r: it.matmul_group(x[r], [wq, wk, wv], [bq, bk, bv], dtype),
        "gate_up": lambda r: it.matmul_group(x[r], [wg, wu], [None, None], dtype),
        "down": lambda r: [it.matmul(xi[r], wd, None, dtype)],
    }
    assert it.tile_for(32, H, device, dtype) == FEW_NARROW and it.tile_for(200, 2 * inter, device, dtype) == SOME_WIDE
    assert it.tile_for(R, 2 * inter, device, dtype) == MANY_WIDE and it.tile_for(R, H, device, dtype) == MANY
    assert it.k_splits(inter, H)[0] > 1
    product_tile = it.tile_for
    for name, call in calls.items():
        monkeypatch.setattr(it, "tile_for", lambda *args: BASE)
        whole = [_as_bits(t) for t in call(slice(0, R))]
        monkeypatch.setattr(it, "tile_for", product_tile)
        assert all(torch.equal(p, w) for p, w in zip([_as_bits(t) for t in call(slice(0, R))], whole)), name
        for rows in (1, 8, 32, 64, 65, 128, 256, 257, 1024):
            for start in (0, 77):
                part = [_as_bits(t) for t in call(slice(start, start + rows))]
                assert all(torch.equal(p, w[start:start + rows]) for p, w in zip(part, whole)), (name, rows, start)
