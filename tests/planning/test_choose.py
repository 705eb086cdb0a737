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
