#!/usr/bin/env bash
# The device calls on one H200 that measure the step, decode and update numbers, each tool in its own process:
#   run(kind=nvidia-h200, carry=[".whl"], command="BENCH_COMMIT=<sha> ROUND_PART=1 bash benchmarks/gpu_round.sh", timeout_s=600)
# 1. TRL's GRPOTrainer (HF generate, no vLLM) on the anchor workload at 0.5B and 1.5B, FIRST, so that our table
#    (which reads trl_<preset>.json from the same directory) carries the speed-up column (wheels from .whl or
#    .whl-trl: trl, datasets, dill, multiprocess, xxhash),
# 2. our GRPO step loop, tuned, 0.5B and 1.5B, with the profile (busy fraction, top kernels, idle gaps),
# 3. the same loop with the default config (`auto` sizes) at 0.5B and 1.5B,
# 4. PPO with a critic (GAE) at 0.5B, default config, with the profile.
# All four stages need ~10-12 minutes, over one call's 10: ROUND_PART=1 runs stages 1-3 (TRL, tuned and defaults
# side by side in one call), ROUND_PART=2 stage 4; unset = all.
# The GPU tests need a call of their own (`bash benchmarks/gpu_tests.sh`): with the benchmarks beside them they were
# cut at 83% by a 120 s stage limit. Each stage has its own time limit so a hang in one still returns the others.
# Prefix the command with BENCH_COMMIT=$(git rev-parse --short HEAD) as run here: the device copy's git metadata
# can lag the tree, and the reports stamp that commit otherwise.
set -u
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
PART=${ROUND_PART:-all}
if [ "$PART" != 2 ]; then
for d in .whl .whl-trl; do
  if ls "$d"/trl-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$d"/*.whl
    for p in qwen2.5-0.5b qwen2.5-1.5b; do
      PYTHONPATH=/tmp/site:$PWD timeout 130 python3 -m benchmarks.trl_grpo --preset $p --out "$OUT" --steps 2 \
        >>"$OUT/trl.log" 2>&1
      echo "trl $p rc=$?" | tee -a "$OUT/trl.log"
    done
    break
  fi
done
timeout 210 python3 -m benchmarks.run --suite gpu --out "$OUT" >"$OUT/bench.log" 2>&1
echo "bench rc=$?" | tee -a "$OUT/bench.log"
for p in qwen2.5-0.5b qwen2.5-1.5b; do
  timeout 80 python3 -m benchmarks.run --preset $p --no-tuned --no-profile --steps 2 --tag default \
    --out "$OUT" >>"$OUT/bench.log" 2>&1
  echo "default $p rc=$?" | tee -a "$OUT/bench.log"
done
fi
if [ "$PART" != 1 ]; then
timeout 120 python3 -m benchmarks.run --preset qwen2.5-0.5b --no-tuned --steps 2 --tag ppo_gae \
  --override algorithm.adv_estimator=gae --out "$OUT" >>"$OUT/bench.log" 2>&1
echo "ppo_gae rc=$?" | tee -a "$OUT/bench.log"
fi
cat "$OUT/bench.md"
