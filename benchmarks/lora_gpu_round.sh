#!/usr/bin/env bash
# One device call on one H200 (LoRA, 7B on one GPU, TRL + PEFT anchor), ≤ 9 min of parts:
#   run(kind=nvidia-h200, carry=[".whl"], timeout_s=600,
#       command="BENCH_COMMIT=<short sha> bash benchmarks/lora_gpu_round.sh")
# TRL's wheels (trl, datasets, dill, multiprocess, xxhash) come from .whl/ (or .whl-trl/); peft, accelerate and
# transformers are in the device image. Extra arguments go to benchmarks/lora_gpu.py, e.g. `--parts lora_7b,trl_7b`
# or `--parts switch_0.5b,switch_0.5b_full` for the switch alone. Files back under $OUT: lora_gpu.{jsonl,md,log}.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for d in .whl .whl-trl; do
  if ls "$d"/trl-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$d"/*.whl \
      && export PYTHONPATH=/tmp/site:$PWD
    break
  fi
done
python3 -m benchmarks.lora_gpu --out "$OUT" "$@"
echo "lora_gpu rc=$?"
