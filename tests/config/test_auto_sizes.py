"""`auto` sizes (config/auto_sizes.py): CPU keeps the sizes the CPU learning thresholds were measured with; on GPU the
choices follow the model's shape and the GPU's memory (calibrated to the sizes measured fastest on one H200)."""

from __future__ import annotations

import pytest

from hybridflow.config import load_config
from hybridflow.config.auto_sizes import CPU_VALUES, gpu_values, model_shape
from hybridflow.config.loader import load_defaults_dict
from hybridflow.config.loader import merge as merge_dicts

H200_GIB = 139.8
BENCH = {"data": {"max_prompt_length": 256, "max_response_length": 256, "train_batch_size": 32},
         "rollout": {"n": 8, "max_num_seqs": 256}, "actor": {"ppo_mini_batch_size": 32},
         "critic": {"ppo_mini_batch_size": 32}}


def bench_dict(preset: str, **model) -> dict:
    layer = {**BENCH, "model": {"preset": preset, **model}}
    return merge_dicts(load_defaults_dict(), layer, source="test")


def test_cpu_auto_resolves_to_the_former_defaults() -> None:
    cfg = load_config(overrides=["trainer.device=cpu"])
    assert cfg.actor.ppo_micro_batch_size_per_gpu == CPU_VALUES[("actor", "ppo_micro_batch_size_per_gpu")] == 16
    assert cfg.actor.log_prob_micro_batch_size_per_gpu == 32 and cfg.ref.log_prob_micro_batch_size_per_gpu == 32
    assert cfg.critic.ppo_micro_batch_size_per_gpu == 16
    assert cfg.actor.logprob_chunk_size == 1024 and cfg.rollout.free_cache_engine is True


def test_explicit_values_win() -> None:
    cfg = load_config(overrides=["trainer.device=cpu", "actor.ppo_micro_batch_size_per_gpu=4",
                                 "rollout.free_cache_engine=false", "actor.logprob_chunk_size=512"])
    assert cfg.actor.ppo_micro_batch_size_per_gpu == 4
    assert cfg.rollout.free_cache_engine is False and cfg.actor.logprob_chunk_size == 512


@pytest.mark.parametrize("preset,micro", [("qwen2.5-0.5b", 64), ("qwen2.5-1.5b", 32)])
def test_gpu_choices_match_the_sizes_measured_fastest(preset: str, micro: int) -> None:
    merged = bench_dict(preset)
    v = gpu_values(merged, model_shape(merged), H200_GIB)
    assert v[("actor", "ppo_micro_batch_size_per_gpu")] == micro
    assert v[("actor", "log_prob_micro_batch_size_per_gpu")] == max(32, micro)
    assert v[("actor", "logprob_chunk_size")] == 4096
    assert v[("rollout", "free_cache_engine")] is False


def test_gpu_choices_shrink_with_the_model_and_free_the_cache_when_state_is_large() -> None:
    full = bench_dict("qwen2.5-7b")
    v = gpu_values(full, model_shape(full), H200_GIB)
    assert v[("rollout", "free_cache_engine")] is True  # fp32 state of 7B ≈ 120 GiB: no room to keep the cache
    assert 1 <= v[("actor", "ppo_micro_batch_size_per_gpu")] <= 4
    lora = bench_dict("qwen2.5-7b", lora={"rank": 64})
    w = gpu_values(lora, model_shape(lora), H200_GIB)
    assert w[("rollout", "free_cache_engine")] is False
    assert 8 <= w[("actor", "ppo_micro_batch_size_per_gpu")] <= 32
    # always a divisor of the per-GPU mini-batch (32 prompts x 8 samples)
    assert 256 % w[("actor", "ppo_micro_batch_size_per_gpu")] == 0
