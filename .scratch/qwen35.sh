#!/bin/bash
# Qwen3.5 (issue #20) on the H200: the GPU tests, then rollout tok/s (native engine vs HF generate) and the
# bf16 engine/trainer log-prob mismatch at the Qwen3.5-0.8B-like shape. One JSON line per measurement.
cd "$(dirname "$0")/.."
python -c "import importlib.util as u; print('fla importable:', u.find_spec('fla') is not None)"
timeout 50 python -m pytest -q -s -k "gpu or triton" tests/test_qwen35.py 2>&1 | grep -E "passed|failed|skipped|Error|assert|mean \|diff\|" | tail -12
timeout 70 python benchmarks/families.py --shape "${SHAPE:-qwen35-0.8b}" --case rollout_native,mismatch,rollout_hf --repeats 1 2>&1 \
  | grep -E '^\{|Error|error' | tail -12
