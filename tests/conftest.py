"""Test setup: import phaserl from this checkout, keep every cache in a temp dir, skip GPU tests on CPU, and
fail the session when a test wrote into the source tree (phaserl/): a test writes under tmp_path, never next
to the code."""
import os
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Tests never write outside temporary directories: phaserl's first-use cache (the tiny world's prompt files,
# the tiny reward model) and matplotlib's font cache go to one temp dir that later sessions reuse (set here,
# before anything imports phaserl, so subprocesses inherit it).
TEST_CACHE = os.path.join(tempfile.gettempdir(), f"phaserl-test-cache-{os.getuid()}")
os.environ["PHASERL_CACHE_DIR"] = TEST_CACHE
os.environ["MPLCONFIGDIR"] = os.path.join(TEST_CACHE, "matplotlib")

# A session run under Triton's CPU interpreter (TRITON_INTERPRET=1) gets the fixed-order dot that the interpreted
# scripts get (tests/_interpreted.py says why).
if os.environ.get("TRITON_INTERPRET") == "1":
    import importlib.util

    if importlib.util.find_spec("triton") is not None:
        from _interpreted import fix_dot_order

        fix_dot_order()


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _source_files() -> dict:
    """phaserl/'s files (not __pycache__) -> (size, mtime)."""
    out = {}
    for folder, dirs, files in os.walk(os.path.join(ROOT, "phaserl")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            stat = os.stat(os.path.join(folder, name))
            out[os.path.relpath(os.path.join(folder, name), ROOT)] = (stat.st_size, stat.st_mtime_ns)
    return out


def pytest_sessionstart(session):
    session.config._phaserl_sources = _source_files()


def pytest_sessionfinish(session, exitstatus):
    before, after = session.config._phaserl_sources, _source_files()
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        print(f"\nthe tests wrote into the source tree (a test must write under tmp_path): {changed}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
