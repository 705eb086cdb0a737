"""The planner's search: the largest micro-batch that fits shrinks with the GPU's memory; a config that fits is
kept as it is."""

import pytest

from hybridflow.config import load_config
from hybridflow.planning.choose import DoesNotFit, choose, fit_micro_batch
from hybridflow.planning.from_config import plan_inputs
from hybridflow.planning.step_time import GPUS, Gpu

OVERRIDES = ["model.preset=qwen2.5-1.5b", "data.max_prompt_length=256", "data.max_response_length=256",
             "rollout.n=8", "data.train_batch_size=32", "actor.ppo_mini_batch_size=32",
             "actor.ppo_micro_batch_size_per_gpu=16"]


def _gpu(gib: float) -> Gpu:
    h200 = GPUS["h200"]
    return Gpu("test", gib, h200.bf16_flops, h200.copy_bytes_per_s)


def test_fit_micro_batch_shrinks_with_memory():
    inputs = plan_inputs(load_config(overrides=OVERRIDES, validate=False))
    tokens = [fit_micro_batch(inputs, _gpu(gib)) for gib in (139.7, 60.0, 45.0)]
    assert tokens[0] > tokens[1] > tokens[2] >= 512, tokens
    with pytest.raises(DoesNotFit, match="not even one sequence"):
        fit_micro_batch(inputs, _gpu(20.0))


def test_a_config_that_fits_is_kept():
    inputs = plan_inputs(load_config(overrides=OVERRIDES, validate=False))
    assert choose(inputs, GPUS["h200"]).overrides == []


def test_low_bit_optimizer_state_is_counted_and_never_paired_with_cpu_step():
    from hybridflow.planning.choose import _candidates

    fp32 = plan_inputs(load_config(overrides=OVERRIDES, validate=False)).engines["actor"]
    eight = plan_inputs(load_config(overrides=[*OVERRIDES, "actor.optim.optimizer=adamw_8bit"],
                                    validate=False))
    assert eight.engines["actor"].optimizer_gpu_bytes() < fp32.optimizer_gpu_bytes() / 3.5  # ~2 vs 8 bytes
    offloads = lambda inputs: {c.get("actor.fsdp.optimizer_offload") for _, c in _candidates(inputs)}  # noqa: E731
    assert "cpu_step" in offloads(plan_inputs(load_config(overrides=OVERRIDES, validate=False)))
    assert "cpu_step" not in offloads(eight)
