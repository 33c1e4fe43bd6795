"""Run a test script in a fresh Python under Triton's CPU interpreter (TRITON_INTERPRET is read once, at Triton's
import: a session that has imported Triton already cannot switch it on)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

# this Triton's interpreter turns size-1 arrays into ints, which numpy >= 2.4 refuses with this message
NUMPY_TOO_NEW = "only 0-dimensional arrays can be converted to Python scalars"


def run_interpreted(script: str, timeout: int = 300) -> None:
    """Run `script` with the repository on the path; skip where numpy is too new for the interpreter; a failure's
    stderr is the assertion's message."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    if NUMPY_TOO_NEW in done.stderr:
        pytest.skip("this Triton's interpreter turns size-1 arrays into ints, which numpy >= 2.4 refuses")
    assert done.returncode == 0, done.stderr[-3000:]
