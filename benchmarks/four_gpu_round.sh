#!/usr/bin/env bash
# Issue 14 on four H200s (kind nvidia-h200-x4), Ray carried as wheels in .whl (../shared/tools/device-wheels.sh ray==2.60.0).
# Two device calls (10 minutes each at most), one per model shape:
#   run(kind=nvidia-h200-x4, carry=[".whl"], command="PRESET=qwen2.5-1.5b bash benchmarks/four_gpu_round.sh", timeout_s=600)
#   run(kind=nvidia-h200-x4, carry=[".whl"], command="PRESET=qwen2.5-7b bash benchmarks/four_gpu_round.sh", timeout_s=600)
# Each: `hybridflow train` to its first step (PPO, 4 ranks), then on 4 ranks PPO with a critic colocated (one process
# per GPU: the hybrid engine) and split (one process per role on the same GPUs), and GRPO colocated; per stage,
# peak memory per GPU, GPU busy over one profiled step, driver→workers RPC round trip, and the update stages' time
# outside the workers' own compute (the batch reaching the critic). The CPU version of the same code runs in the
# test suite (tests/benchmarks, 4 gloo ranks).
# Prefix the command with BENCH_COMMIT=$(git rev-parse --short HEAD) as run here: the device copy's git metadata
# can lag the tree, and the reports stamp that commit otherwise.
set -u
OUT=${OUT:-bench_out}
PRESET=${PRESET:-qwen2.5-1.5b}
PROMPTS=${PROMPTS:-64}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
timeout 560 python3 -m benchmarks.two_gpu --out "$OUT" --prompts "$PROMPTS" --kill-stage none --budget-s 480 \
  --cli-startup "ppo:$PRESET:4" --case "ppo:$PRESET:4" --case "ppo:$PRESET:4:2:split" --case "grpo:$PRESET:4" \
  >"$OUT/four_gpu.log" 2>&1
echo "four_gpu rc=$?"
cat "$OUT/two_gpu.md"
