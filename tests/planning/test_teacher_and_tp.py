"""The planner counts a distillation teacher (its weights where its config keeps them, its forward pass) and
tensor-parallel generation (each rank's weight slices, by the layout the engine slices with, and a cache of its KV
heads)."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridflow.config import load_config
from hybridflow.models.presets import preset_config
from hybridflow.planning.choose import _candidates
from hybridflow.planning.from_config import plan_inputs
from hybridflow.planning.memory import GiB, kv_bytes_per_slot, plan_memory
from hybridflow.planning.model_shape import ModelShape, tp_slice_numel
from hybridflow.rollout.tp_layout import TPLayout, param_slice
from hybridflow.rollout.weights import arch_spec

GRPO = ["model.preset=qwen2.5-0.5b", "data.max_prompt_length=256", "data.max_response_length=256", "rollout.n=8",
        "data.train_batch_size=32", "actor.ppo_mini_batch_size=32", "actor.ppo_micro_batch_size_per_gpu=8"]
DISTILL = [*GRPO, "algorithm.adv_estimator=distill", "teacher.preset=qwen2.5-1.5b"]
H200 = int(139.7 * GiB)


def _plan(*overrides: str):
    inputs = plan_inputs(load_config(overrides=list(overrides), validate=False))
    return inputs, plan_memory(inputs.engines, inputs.rollout, H200, inputs.stages)


def test_distillation_counts_the_teacher_weights_and_its_forward():
    _, grpo = _plan(*GRPO)
    inputs, distill = _plan(*DISTILL)
    n = ModelShape.from_hf(preset_config("qwen2.5-1.5b").to_dict()).params()  # not the student's shape
    assert "teacher" in inputs.stages and inputs.engines["teacher"].shape.layers == 28
    # one rank: fp32 frozen weights (teacher.fsdp.param_dtype) + FSDP2's kept bf16 unsharded copy, in every stage
    extra = distill.stage("update_actor").total - grpo.stage("update_actor").total
    assert extra == n * (4 + 2), (extra, n)
    teacher = distill.stage("teacher").components
    assert teacher["teacher/params"] == 4 * n and teacher["teacher/unsharded"] == 2 * n
    # its forward: a micro-batch of teacher.log_prob_micro_batch_size_per_gpu sequences and a chunk of logits
    assert teacher["activations"] > 1024 * 151936 * 2 * 2
    assert distill.peak.total - grpo.peak.total == 6 * n  # the peak (update_actor) grows by the teacher's bytes

    # parked on the host between forwards (teacher.fsdp.param_offload): only its own stage holds them
    _, parked = _plan(*DISTILL, "teacher.fsdp.param_offload=true", "teacher.fsdp.param_dtype=bfloat16")
    assert parked.stage("update_actor").total == grpo.stage("update_actor").total
    assert parked.stage("teacher").components["teacher/params"] == 2 * n
    assert parked.host_bytes == grpo.host_bytes + 2 * n


def test_the_search_may_park_the_teacher():
    inputs, _ = _plan(*DISTILL)
    assert any(c.get("teacher.fsdp.param_offload") is True for _, c in _candidates(inputs))


def _layout_numel(model: torch.nn.Module, tp: int, rank: int) -> int:
    """Elements of rank `rank`'s slices as rollout/tp_layout.py cuts them (padding rows included)."""
    spec, total = arch_spec(model), 0
    for name, p in model.named_parameters():
        sl = param_slice(name.removeprefix("model."), p.shape, spec, TPLayout(tp, rank))
        total += p.numel() if sl is None else p.numel() // p.shape[sl.dim] * max(sl.length, sl.pad_to)
    return total


@pytest.mark.parametrize("tied", [False, True])
def test_tp_slice_numel_is_the_layout(tied):
    # vocab 203 pads the last rank's shard; 2 KV heads are split at tp=2 and replicated at tp=4
    hf = Qwen2Config(vocab_size=203, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model, shape = Qwen2ForCausalLM(hf), ModelShape.from_hf(hf.to_dict())
    assert tp_slice_numel(shape, 1) == shape.params()
    for tp in (2, 4):
        assert {_layout_numel(model, tp, r) for r in range(tp)} == {tp_slice_numel(shape, tp)}, tp


def test_tensor_parallel_generation_holds_slices_and_its_kv_heads():
    two = ["trainer.n_gpus_per_node=2", "rollout.free_cache_engine=true", "rollout.kv_cache_tokens=65536"]
    in1, tp1 = _plan(*GRPO, *two)
    in2, tp2 = _plan(*GRPO, *two, "rollout.tensor_model_parallel_size=2")
    shape, rollout = in2.engines["actor"].shape, in2.rollout
    gen1, gen2 = tp1.stage("generate").components, tp2.stage("generate").components
    assert gen1["rollout/weights"] == 2 * shape.params()  # a full bf16 copy on each of 2 ranks
    assert gen2["rollout/weights"] == 2 * tp_slice_numel(shape, 2) < 0.6 * gen1["rollout/weights"]
    # Qwen2.5-0.5B has 2 KV heads: one per rank, half the bytes a cached sequence takes
    assert kv_bytes_per_slot(shape, rollout, 2) * 2 == kv_bytes_per_slot(shape, in1.rollout, 2)
    assert tp2.kv_slots == tp1.kv_slots and gen2["rollout/kv_cache"] * 2 == gen1["rollout/kv_cache"]
    # the resharder refills its slices in place: kept while training, where a freed full copy is not
    assert tp2.stage("update_actor").components["rollout/weights"] == gen2["rollout/weights"]
    assert tp1.stage("update_actor").components["rollout/weights"] == 0
    # the group prefills its two members' prompts together, each rank half the heads and MLP rows, and its decode
    # logits are a vocabulary shard: (tokens, per-token temporaries, fp32 logits of the cached rows)
    h, q, kv, inter, vocab = shape.hidden, shape.q_dim, shape.kv_dim, shape.inter, shape.vocab
    prompts = rollout.prompts_per_gpu * rollout.prompt_len
    assert gen1["activations"] == prompts * 2 * (2 * h + q + 2 * kv + 2 * inter) + 128 * vocab * 4
    assert gen2["activations"] == 2 * prompts * 2 * (2 * h + q // 2 + kv + inter) + 128 * (vocab // 2) * 4
