#!/usr/bin/env bash
# Generation against vLLM 0.26 in the same lease (benchmarks only; vLLM is never a dependency of hybridflow).
# Workload of both: 256 distinct random prompts x (256 prompt + 256 new tokens), ignore_eos, random-init Qwen2.5
# shapes, bf16, temperature 1; vLLM with prefix caching off and fresh prompts each repeat; ours = benchmarks/rollout.py.
# Needs vLLM in /tmp/site and its script at /tmp/vl/vllm_bench.py: ../shared/tools/vllm-anchor.sh prepares four
# chunks, four device calls back to back unpack them (the script's header); this is then one more call while the
# machine is warm:
#   run(kind=nvidia-h200, command="BENCH_COMMIT=<sha> bash benchmarks/vllm_round.sh", timeout_s=600)
# SHAPES="qwen2.5-7b" limits the shapes; output under $OUT: ours_<shape>.json, vllm_<shape>.json, vllm_compare.md.
set -u
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for s in ${SHAPES:-qwen2.5-0.5b qwen2.5-1.5b qwen2.5-7b}; do
  PYTHONPATH=$PWD timeout 200 python3 -m benchmarks.rollout --out "$OUT/ours_$s.json" --cases "$s:256" --hf-cases "" \
    >>"$OUT/ours.log" 2>&1
  echo "ours $s rc=$?"
  HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONPATH=/tmp/site timeout 240 \
    python3 /tmp/vl/vllm_bench.py "$s" 256 256 256 >"$OUT/vllm_$s.out" 2>>"$OUT/vllm.log"
  echo "vllm $s rc=$?"
  grep '^{' "$OUT/vllm_$s.out" | tail -1 >"$OUT/vllm_$s.json"
done
PYTHONPATH=$PWD python3 -m benchmarks.vllm_compare "$OUT"
