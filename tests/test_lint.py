"""The lint rule: `ruff check` over the library, the tests, the benchmarks and the examples finds nothing.

The rule itself (line length 120; pyflakes, pycodestyle, import order) lives in pyproject.toml's [tool.ruff];
this test only runs it, so the suite (and so CI) fails on a finding. It does not format anything.
"""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = ["phaserl", "tests", "benchmarks", "examples"]
FINDING = re.compile(r"^\S+:\d+:\d+: ")  # path:line:column: CODE message


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                    reason="ruff is not installed (the test extra brings it: pip install -e '.[test]')")
def test_ruff_finds_nothing():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *PATHS],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        findings = [line for line in out.stdout.splitlines() if FINDING.match(line)]
        pytest.fail(f"`ruff check {' '.join(PATHS)}` found {len(findings)} problem(s); fix them by hand "
                    "(`ruff check --fix` sorts imports and drops unused ones):\n"
                    + "\n".join(findings or [out.stdout]) + out.stderr, pytrace=False)
