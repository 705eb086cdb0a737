#!/usr/bin/env bash
# One device call on one H200 that measures everything issue 12 reports, each tool in its own process:
#   run(kind=nvidia-h200, carry=[".whl-trl"], command="bash benchmarks/gpu_round.sh", timeout_s=600)
# 1. our GRPO step loop, tuned, 0.5B and 1.5B, with the profile (busy fraction, top kernels, idle gaps),
# 2. the same loop on the 0.5B shape with the default config,
# 3. TRL's GRPOTrainer on the anchor workload (wheels from .whl-trl: trl, datasets, dill, multiprocess, xxhash),
# 4. the GPU kernel and engine tests in-process (the CPU suite runs the kernels under Triton's interpreter only).
# Each stage has its own time limit so a hang in one still returns the others (the device call is 600 s).
# At most 8 files come back from $OUT; this writes 8. The TRL ratio is read from trl_*.json afterwards.
# Prefix the command with BENCH_COMMIT=$(git rev-parse --short HEAD) as run here: the device copy's git metadata
# can lag the tree, and the reports stamp that commit otherwise.
set -u
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 210 python3 -m benchmarks.run --suite gpu --out "$OUT" >"$OUT/bench.log" 2>&1
echo "bench rc=$?" | tee -a "$OUT/bench.log"
timeout 70 python3 -m benchmarks.run --preset qwen2.5-0.5b --no-tuned --no-profile --steps 2 --tag default \
  --out "$OUT" >>"$OUT/bench.log" 2>&1
echo "default rc=$?" | tee -a "$OUT/bench.log"
if ls .whl-trl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl-trl/*.whl
  PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m benchmarks.trl_grpo --out "$OUT" --steps 3 >"$OUT/trl.log" 2>&1
  echo "trl rc=$?" | tee -a "$OUT/trl.log"
fi
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/rollout tests/engine/test_logprobs.py tests/engine/test_train_engine.py \
  >"$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?" | tee -a "$OUT/gpu_tests.log"
tail -3 "$OUT/gpu_tests.log"
cat "$OUT/bench.md"
