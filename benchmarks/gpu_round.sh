#!/usr/bin/env bash
# One device call on one H200 that measures everything issue 12 reports, in one process per tool:
#   run(kind=nvidia-h200, carry=[".whl-trl"], command="bash benchmarks/gpu_round.sh")
# 1. the GPU kernel and engine tests in-process (the CPU suite runs the kernels under Triton's interpreter only),
# 2. TRL's GRPOTrainer on the anchor workload (wheels from .whl-trl: trl, datasets, dill, multiprocess, xxhash),
# 3. our GRPO step loop, tuned, 0.5B and 1.5B, with the profile (busy fraction, top kernels, idle gaps),
#    which reads TRL's JSON from the same directory and reports the ratio.
# At most 8 files come back from $OUT; this writes 7.
set -u
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -m pytest -q -p no:cacheprovider tests/rollout tests/engine/test_logprobs.py >"$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?" | tee -a "$OUT/gpu_tests.log"
if ls .whl-trl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl-trl/*.whl
  PYTHONPATH=/tmp/site:$PWD python3 -m benchmarks.trl_grpo --out "$OUT" --steps 3 >"$OUT/trl.log" 2>&1
  echo "trl rc=$?" | tee -a "$OUT/trl.log"
fi
python3 -m benchmarks.run --suite gpu --out "$OUT" >"$OUT/bench.log" 2>&1
echo "bench rc=$?"
cat "$OUT/bench.md"
