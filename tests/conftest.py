"""Test setup: import phaserl from this checkout, skip GPU tests on CPU, and fail the session when a test
wrote into the source tree (phaserl/): a test writes under tmp_path, never next to the code."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


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
