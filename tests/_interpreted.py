"""What the bitwise kernels' tests share: run a test script in a fresh Python under Triton's CPU interpreter
(TRITON_INTERPRET is read once, at Triton's import: a session that has imported Triton already cannot switch it on),
compare tensors bit for bit, and set invariant_triton's module constants for a block (the interpreter's subprocess
has no monkeypatch)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

# this Triton's interpreter turns size-1 arrays into ints, which numpy >= 2.4 refuses with this message
NUMPY_TOO_NEW = "only 0-dimensional arrays can be converted to Python scalars"

# The interpreter's tl.dot is numpy's matmul, which hands float blocks to the BLAS numpy ships (OpenBLAS). Some of
# its CPU kernels sum a row's products in an order that depends on the row's place in the block (on an AMD EPYC
# with AVX-512 the default kernel does, OPENBLAS_CORETYPE=SkylakeX's does not), so a row computed alone would differ
# from the same row in a batch for reasons no GPU shares. fix_dot_order (run first in every interpreted script and
# in a pytest session under TRITON_INTERPRET=1, conftest.py) sums each output element's products in k order instead
# (np.einsum, no BLAS): one fixed order per element, as the kernels' contract assumes of a K step.
def fix_dot_order() -> None:
    """Make this process's interpreter dot sum each float output element's products in k order (np.einsum)."""
    import numpy as np
    from triton.runtime import interpreter

    blas_dot = interpreter.InterpreterBuilder.create_dot

    def fixed_order_dot(self, a, b, d, *rest):
        if a.data.dtype in (np.float16, np.float32, np.float64) and b.data.dtype == a.data.dtype:
            out = np.einsum("ik,kj->ij", a.data, b.data, dtype=d.data.dtype, optimize=False) + d.data
            return interpreter.TensorHandle(out, d.dtype.scalar)
        return blas_dot(self, a, b, d, *rest)

    interpreter.InterpreterBuilder.create_dot = fixed_order_dot


def run_interpreted(script: str, timeout: int = 300) -> None:
    """Run `script` with the repository on the path; skip where numpy is too new for the interpreter; a failure's
    stderr is the assertion's message."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([root, here, os.environ.get("PYTHONPATH", "")])}
    prologue = "from _interpreted import fix_dot_order\nfix_dot_order()\n"
    done = subprocess.run([sys.executable, "-c", prologue + script], env=env, capture_output=True, text=True,
                          timeout=timeout)
    if NUMPY_TOO_NEW in done.stderr:
        pytest.skip("this Triton's interpreter turns size-1 arrays into ints, which numpy >= 2.4 refuses")
    assert done.returncode == 0, done.stderr[-3000:]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (torch.equal would take -0.0 for +0.0)."""
    return t.view({torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[t.dtype])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a.contiguous()), bits(b.contiguous()))


@contextlib.contextmanager
def triton_constants(**values):
    """invariant_triton's module constants (SPLIT_K, DEEP_MIN_K, ...) set to `values` for the block."""
    from phaserl.models import invariant_triton

    saved = {name: getattr(invariant_triton, name) for name in values}
    for name, value in values.items():
        setattr(invariant_triton, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(invariant_triton, name, value)
