"""The bitwise mode's fused launches (models/invariant_fused.py, models/invariant_triton.py): RoPE of the queries and
keys in one kernel, act(gate) * up in one, the residual add in the matmul's epilogue, and q/k/v (gate/up) in one
matmul launch. Each must give a row the same bits whatever shares the call (a decode step's rows and the training
forward's [B, T] tokens alike), and must give exactly the bits of the torch ops or separate calls they replace (the
rotation's products and sums rounded one by one; each projection's own call, which the trainer's update takes with a
gradient wanted).
The kernel checks run in Triton's CPU interpreter (a fresh process: Triton reads TRITON_INTERPRET once) in float32
and float16: the interpreter truncates float32 to bfloat16 instead of rounding it, so bfloat16 is checked on CUDA
only (@pytest.mark.gpu), where the activation must also equal torch's bits (CUDA's libdevice exp/tanh are torch's).
"""
import contextlib
import importlib.util
import os

import pytest
import torch

from _interpreted import run_interpreted, triton_constants
from _interpreted import same_bits as _same
from phaserl.models import invariant, invariant_fused, invariant_triton


def check_rotate(device: str, dtypes) -> None:
    """Queries and keys of a [B, T] training batch rotated in one launch equal torch's ops bit for bit, and so do
    the same tokens rotated as decode rows [b, heads, D] (any subset, any order) and a strided query view."""
    g = torch.Generator(device=device).manual_seed(0)
    B, T, Hq, Hkv, D = 3, 5, 6, 2, 16
    for dtype in dtypes:
        q = torch.randn(B, T, Hq, D, generator=g, device=device).to(dtype)
        k = torch.randn(B, T, Hkv, D, generator=g, device=device).to(dtype)
        cos, sin = (torch.randn(B, T, D, generator=g, device=device).to(dtype) for _ in range(2))
        qo, ko = invariant_fused.rotate([q, k], cos, sin)
        assert _same(qo, invariant._rotate_torch(q, cos, sin)), dtype
        assert _same(ko, invariant._rotate_torch(k, cos, sin)), dtype
        flat = lambda t: t.reshape(B * T, *t.shape[2:])  # noqa: E731  [B T, ...] decode rows
        for idx in ([0], [7], [3, 11], [14, 0, 5]):
            dq, dk = invariant_fused.rotate([flat(q)[idx], flat(k)[idx]], flat(cos)[idx], flat(sin)[idx])
            assert _same(dq, flat(qo)[idx]) and _same(dk, flat(ko)[idx]), (dtype, idx)
        fused = torch.randn(B * T, (Hq + 2 * Hkv) * D, generator=g, device=device).to(dtype)  # a [q; k; v] output
        qv = fused[:, :Hq * D].unflatten(-1, (Hq, D))  # strided rows
        assert _same(invariant_fused.rotate([qv], flat(cos), flat(sin))[0],
                     invariant._rotate_torch(qv, flat(cos), flat(sin))), ("strided query view", dtype)
        pq, pk = invariant.rotate_pair(q, k, cos, sin)
        assert _same(pq, qo) and _same(pk, ko), ("rotate_pair", dtype)


def check_rotate_gradient(device: str) -> None:
    """With a gradient wanted, rotate_pair's outputs are the same bits and the gradient is torch's ops'."""
    g = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(4, 3, 8, generator=g, device=device, requires_grad=True)
    k = torch.randn(4, 1, 8, generator=g, device=device, requires_grad=True)
    cos, sin = torch.randn(4, 8, generator=g, device=device), torch.randn(4, 8, generator=g, device=device)
    pq, pk = invariant.rotate_pair(q, k, cos, sin)
    (pq.sum() * 2 + pk.sum()).backward()
    got = q.grad.clone(), k.grad.clone()
    q.grad, k.grad = None, None
    (invariant._rotate_torch(q, cos, sin).sum() * 2 + invariant._rotate_torch(k, cos, sin).sum()).backward()
    assert torch.equal(got[0], q.grad) and torch.equal(got[1], k.grad)
    with torch.no_grad():
        assert _same(pq, invariant._rotate_torch(q, cos, sin))


def check_gated(device: str, dtypes, exact_torch: bool) -> None:
    """act(gate) * up: a row's bits whatever shares the call ([N, I] rows, [B, T, I] tokens, subsets); torch's
    numbers within an ulp of the activation (exact_torch: bit for bit, CUDA's libdevice)."""
    g = torch.Generator(device=device).manual_seed(2)
    for dtype in dtypes:
        gate = (torch.randn(6, 7, 300, generator=g, device=device) * 4).to(dtype)  # [B, T, I]
        up = torch.randn(6, 7, 300, generator=g, device=device).to(dtype)
        for act in ("silu", "gelu_pytorch_tanh"):
            whole = invariant.gated(gate, up, act)  # [B, T, I]
            rows, ups = gate.reshape(42, 300), up.reshape(42, 300)
            for idx in ([0], [41], [3, 17], [40, 2, 9]):
                assert _same(invariant_fused.gated(rows[idx], ups[idx], act), whole.reshape(42, 300)[idx]), act
            ref = invariant.activation(gate, act) * up
            if exact_torch:
                assert _same(whole, ref), (dtype, act)
            else:
                torch.testing.assert_close(whole.float(), ref.float(), rtol=2e-3, atol=1e-5)


def check_residual(device: str, dtypes, K: int = 200, M: int = 80, N: int = 70) -> None:
    """The matmul with a residual in its epilogue equals `residual + matmul(...)` bit for bit, with one split and
    with forced splits (either launch), and a row's bits do not depend on the rows beside it."""
    g = torch.Generator(device=device).manual_seed(3)
    for dtype in dtypes:
        x = torch.randn(N, K, generator=g, device=device).to(dtype)
        w = (torch.randn(M, K, generator=g, device=device) * K ** -0.5).to(dtype)
        b = torch.randn(M, generator=g, device=device).to(dtype)
        r = torch.randn(N, M, generator=g, device=device).to(dtype)
        for force in (False, True):
            with triton_constants(DEEP_MIN_K=0, DEEP_RATIO=0, MIN_SPLIT_STEPS=1) if force else contextlib.nullcontext():
                assert invariant_triton.k_splits(K, M)[0] > 1 or not force
                for bias in (None, b):
                    for launch in ("tiles", "splits"):
                        fused = invariant_triton.matmul(x, w, bias, dtype, launch=launch, residual=r)
                        where = (dtype, force, bias is not None, launch)
                        assert _same(fused, r + invariant_triton.matmul(x, w, bias, dtype, launch=launch)), where
                        part = invariant_triton.matmul(x[5:9], w, bias, dtype, launch=launch, residual=r[5:9])
                        assert _same(part, fused[5:9]), ("rows 5-8 alone", *where)
        y = invariant.linear(x, w, b, residual=r)
        assert _same(y, r + invariant.linear(x, w, b)), ("invariant.linear", dtype)


def check_group(device: str, dtypes, K: int = 96, sizes=(80, 16, 16), N: int = 70) -> None:
    """q/k/v (with biases) and gate/up (without) in one launch: each output equals its own invariant.linear call
    bit for bit (with a gradient wanted, the calls are separate: the trainer's update sees the same bits), and a
    row's bits do not depend on the rows beside it."""
    g = torch.Generator(device=device).manual_seed(5)
    for dtype in dtypes:
        x = torch.randn(N, K, generator=g, device=device).to(dtype)
        for biased, ms in ((True, sizes), (False, sizes[:2])):
            ws = [(torch.randn(m, K, generator=g, device=device) * K ** -0.5).to(dtype) for m in ms]
            layers = [torch.nn.Linear(K, m, bias=biased, device=device, dtype=dtype) for m in ms]
            with torch.no_grad():
                for layer, w in zip(layers, ws):
                    layer.weight.copy_(w)
                    if biased:
                        layer.bias.copy_(torch.randn(layer.bias.shape, generator=g, device=device).to(dtype))
                grouped = invariant.linears(x, layers)
                for y, layer in zip(grouped, layers):
                    assert _same(y, invariant.linear(x, layer)), (dtype, biased)
                for y, part in zip(grouped, invariant.linears(x[9:12], layers)):
                    assert _same(part, y[9:12]), ("rows 9-11 alone", dtype, biased)
            with_grad = invariant.linears(x, layers)  # the weights want a gradient: separate calls
            for y, z in zip(grouped, with_grad):
                assert _same(y, z.detach()), ("with a gradient wanted", dtype, biased)


def check_write_kv(device: str, dtypes) -> None:
    """write_kv equals the decode step's index_put: each row's key and value at its own slot and position."""
    g = torch.Generator(device=device).manual_seed(6)
    for dtype in dtypes:
        keys, values = (torch.randn(6, 2, 40, 16, generator=g, device=device).to(dtype) for _ in range(2))
        k, v = (torch.randn(4, 2, 16, generator=g, device=device).to(dtype) for _ in range(2))
        pos = torch.tensor([3, 0, 39, 17], device=device)
        want_k, want_v = keys.clone(), values.clone()
        rows = torch.arange(4, device=device)
        want_k[rows, :, pos], want_v[rows, :, pos] = k, v
        invariant_fused.write_kv(k, v, keys, values, pos)
        assert _same(keys, want_k) and _same(values, want_v), dtype


INTERPRETED = f"""
import sys
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import torch
from test_invariant_fused import (check_gated, check_group, check_residual, check_rotate, check_rotate_gradient,
                                  check_write_kv)
from phaserl.models import invariant_triton
invariant_triton.FUSED = invariant_triton.GROUP = True  # the launches under test, whatever the defaults
dtypes = (torch.float32, torch.float16)
check_group("cpu", dtypes)
check_write_kv("cpu", dtypes)
check_rotate("cpu", dtypes)
check_rotate_gradient("cpu")
check_gated("cpu", dtypes, exact_torch=False)
check_residual("cpu", dtypes)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its CPU interpreter)")
def test_fused_elementwise_and_residual_in_the_interpreter():
    run_interpreted(INTERPRETED)


def test_without_triton_the_torch_ops_run_on_the_cpu():
    """The CPU (no interpreter) keeps the torch ops: rotate_pair is two rotations, gated is activation * up."""
    if invariant_triton.available(torch.device("cpu")):
        pytest.skip("the interpreter is on")
    g = torch.Generator().manual_seed(4)
    q, k, cos, sin = (torch.randn(3, h, 8, generator=g) for h in (2, 1, 1, 1))
    pq, pk = invariant.rotate_pair(q, k, cos[:, 0], sin[:, 0])
    assert _same(pq, invariant._rotate_torch(q, cos[:, 0], sin[:, 0]))
    assert _same(pk, invariant._rotate_torch(k, cos[:, 0], sin[:, 0]))
    gate, up = torch.randn(5, 9, generator=g).bfloat16(), torch.randn(5, 9, generator=g).bfloat16()
    assert _same(invariant.gated(gate, up, "silu"), invariant.activation(gate, "silu") * up)


def _needs_cuda_triton(monkeypatch):
    if not torch.cuda.is_available() or not invariant_triton.available(torch.device("cuda")):
        pytest.skip("needs Triton on CUDA")
    monkeypatch.setattr(invariant_triton, "FUSED", True)  # the launches under test, whatever the defaults
    monkeypatch.setattr(invariant_triton, "GROUP", True)


GPU_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GPU_CHECKS = {  # one test each, so a failure names its check
    "rotate": lambda: check_rotate("cuda", GPU_DTYPES),
    "rotate_gradient": lambda: check_rotate_gradient("cuda"),
    "residual": lambda: check_residual("cuda", GPU_DTYPES),
    "residual_0.5b_down": lambda: check_residual("cuda", (torch.bfloat16,), K=4864, M=896, N=40),  # deep: split
    "group": lambda: check_group("cuda", GPU_DTYPES),
    "group_0.5b_qkv_decode": lambda: check_group("cuda", (torch.bfloat16,), K=896, sizes=(896, 128, 128), N=40),
    "group_0.5b_gate_up": lambda: check_group("cuda", (torch.bfloat16,), K=896, sizes=(4864, 4864), N=300),
    "write_kv": lambda: check_write_kv("cuda", GPU_DTYPES),
}


@pytest.mark.gpu
@pytest.mark.parametrize("check", list(GPU_CHECKS))
def test_gpu_fused_elementwise_and_residual_keep_the_bits(check, monkeypatch):
    _needs_cuda_triton(monkeypatch)
    GPU_CHECKS[check]()


@pytest.mark.gpu
def test_gpu_gated_rows_are_invariant_and_equal_torchs_bits(monkeypatch):
    _needs_cuda_triton(monkeypatch)
    check_gated("cuda", (torch.bfloat16, torch.float16, torch.float32), exact_torch=True)
