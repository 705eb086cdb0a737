#!/usr/bin/env bash
# The tests with CUDA paths, on one H200, in a device call of their own (beside the benchmarks they
# were cut at 83% by a 120 s limit):
#   run(kind=nvidia-h200, command="bash benchmarks/gpu_tests.sh", timeout_s=600)
set -u
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 560 python3 -m pytest -q -p no:cacheprovider tests/rollout tests/engine tests/e2e/test_resume.py \
  tests/e2e/test_multi_turn_e2e.py tests/e2e/test_multi_turn_interaction_e2e.py >"$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?" | tee -a "$OUT/gpu_tests.log"
tail -5 "$OUT/gpu_tests.log"
