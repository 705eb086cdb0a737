#!/usr/bin/env bash
# 7B on one H200, full fine-tuning against LoRA in the same device call (≤ 10 min), each part its own process:
#   run(kind=nvidia-h200, timeout_s=600, command="BENCH_COMMIT=<short sha> bash benchmarks/scale_7b_round.sh A")
# A: the 7B LoRA step (benchmarks/lora_gpu.py lora_7b), 7B full fine-tuning with the CPU optimizer step, reference
#    model and KL loss (benchmarks/cpu_step_7b.py) with gradient checkpointing, and without it at 8k-token
#    micro-batches.
# B: PPO with a critic: actor 7B (cpu_step) + critic 1.5B (GAE); full fine-tuning without checkpointing with the
#    reference's weights on the CPU between uses; then TRL 1.16 full fine-tuning of the 7B shape
#    (HF generate, no vLLM; needs TRL's wheels in .whl/, carry=[".whl"]).
# Files back under $OUT: one JSON per part and scale_7b.log.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
LOG="$OUT/scale_7b.log"
part() { echo "=== $* ($(date -u +%H:%M:%S))" | tee -a "$LOG"; "$@" >>"$LOG" 2>&1; echo "rc=$?" | tee -a "$LOG"; }
case "${1:-A}" in
  A)
    part python3 -m benchmarks.lora_gpu --out "$OUT/lora" --parts lora_7b --steps 3
    part python3 -m benchmarks.cpu_step_7b --out "$OUT" --name full_7b --steps 3
    part python3 -m benchmarks.cpu_step_7b --out "$OUT" --name full_7b_nockpt --steps 3 \
      --override model.enable_gradient_checkpointing=false --override actor.ppo_max_token_len_per_gpu=8192
    ;;
  B)
    part python3 -m benchmarks.cpu_step_7b --out "$OUT" --name ppo_7b_critic_1.5b --steps 3 --critic-preset qwen2.5-1.5b \
      --override critic.ppo_mini_batch_size=32 --override critic.use_dynamic_bsz=true \
      --override critic.ppo_max_token_len_per_gpu=16384 --override critic.fsdp.optimizer_offload=true
    part python3 -m benchmarks.cpu_step_7b --out "$OUT" --name full_7b_nockpt_refoff --steps 3 \
      --override model.enable_gradient_checkpointing=false --override actor.ppo_max_token_len_per_gpu=8192 \
      --override ref.fsdp.param_offload=true
    if ls .whl/trl-*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
      PYTHONPATH=/tmp/site:$PWD part python3 -m benchmarks.trl_grpo --out "$OUT/trl" --preset qwen2.5-7b --steps 1 --ga 8
    fi
    ;;
esac
tail -5 "$LOG"
