#!/usr/bin/env bash
# One device call on two H200s, Ray carried as wheels in .whl (../shared/tools/device-wheels.sh ray==2.60.0):
#   run(kind=nvidia-h200-x2, carry=[".whl"], command="bash benchmarks/two_gpu_round.sh", timeout_s=600)
# 1. (TESTS=1, default) the GPU kernel and engine tests in-process on GPU 0,
# 2. GRPO 1.5B with 64 prompts x 8 (512 rows) on 1 then 2 GPUs, then the kill test,
# 3. GRPO 0.5B with the anchor workload (32 x 8) on 1 then 2 GPUs,
# 4. (ABLATE=1) GRPO 1.5B at 512 rows on 2 GPUs with actor.fsdp.defer_grad_sync=false (a reduce-scatter per
#    micro-batch), to see what deferring it is worth in the same call.
# At most 8 files come back from $OUT: one log, a JSON and a markdown per run (7 with TESTS=0).
# Prefix the command with BENCH_COMMIT=$(git rev-parse --short HEAD) as run here: the device copy's git metadata
# can lag the tree, and the reports stamp that commit otherwise.
set -u
OUT=${OUT:-bench_out}
mkdir -p "$OUT/big" "$OUT/anchor" "$OUT/ablate"
export PYTHONUNBUFFERED=1
if [ "${TESTS:-1}" = 1 ]; then
  CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider --durations=8 \
    tests/rollout tests/engine/test_logprobs.py tests/engine/test_train_engine.py >"$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?" | tee -a "$OUT/gpu_tests.log"
  tail -14 "$OUT/gpu_tests.log"
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 -m benchmarks.two_gpu --out "$OUT/big" --prompts 64 --budget-s 170 \
  --case grpo:qwen2.5-1.5b:1 --case grpo:qwen2.5-1.5b:2 >>"$OUT/two_gpu.log" 2>&1
echo "big rc=$?"
timeout 130 python3 -m benchmarks.two_gpu --out "$OUT/anchor" --kill-stage none --budget-s 110 \
  --case grpo:qwen2.5-0.5b:1 --case grpo:qwen2.5-0.5b:2 >>"$OUT/two_gpu.log" 2>&1
echo "anchor rc=$?"
if [ "${ABLATE:-0}" = 1 ]; then
  timeout 90 python3 -m benchmarks.two_gpu --out "$OUT/ablate" --prompts 64 --kill-stage none \
    --override actor.fsdp.defer_grad_sync=false --case grpo:qwen2.5-1.5b:2 >>"$OUT/two_gpu.log" 2>&1
  echo "ablate rc=$?"
fi
cat "$OUT/big/two_gpu.md" "$OUT/anchor/two_gpu.md" "$OUT/ablate/two_gpu.md" 2>/dev/null
