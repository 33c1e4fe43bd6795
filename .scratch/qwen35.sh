#!/bin/bash
# Qwen3.5 (issue #20) on the H200: the GPU tests, then the bf16 engine/trainer log-prob mismatch and rollout tok/s
# (native engine vs HF generate) at the Qwen3.5-0.8B-like shape. One JSON line per measurement.
cd "$(dirname "$0")/.."
python3 -c "import importlib.util as u; print('fla importable:', u.find_spec('fla') is not None, 'torch:', u.find_spec('torch') is not None)"
timeout 50 python3 -m pytest -v -s --tb=line -p no:cacheprovider -k "gpu or triton" tests/test_qwen35.py 2>&1 \
  | grep -E "PASSED|FAILED|SKIPPED|ERROR|Error|mean \|diff\|" | tail -14
timeout 65 python3 benchmarks/families.py --shape "${SHAPE:-qwen35-0.8b}" --case mismatch,rollout_native,rollout_hf \
  --repeats 1 2>&1 | grep -E '^\{|Error|error' | tail -12
