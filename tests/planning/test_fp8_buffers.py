"""The planner counts the fp8 rollout's weight copies (rollout.quantization=fp8): 1 byte a decoder-projection element
and an fp32 scale per output channel, at generation, and between steps unless the cache is freed."""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridflow.config import load_config
from hybridflow.models.presets import preset_config
from hybridflow.planning.from_config import plan_inputs
from hybridflow.planning.memory import GiB, fp8_weight_bytes, plan_memory
from hybridflow.planning.model_shape import ModelShape
from hybridflow.rollout.fp8 import Fp8Weights
from hybridflow.rollout.weights import WeightView

GRPO = ["model.preset=qwen2.5-0.5b", "data.max_prompt_length=256", "data.max_response_length=256", "rollout.n=8",
        "data.train_batch_size=32", "actor.ppo_mini_batch_size=32", "actor.ppo_micro_batch_size_per_gpu=8",
        "rollout.gpu_memory_utilization=0.5", "rollout.kv_cache_tokens=null", "rollout.max_num_seqs=100000"]
H200 = int(139.7 * GiB)


def _plan(*overrides: str):
    inputs = plan_inputs(load_config(overrides=list(overrides), validate=False))
    return plan_memory(inputs.engines, inputs.rollout, H200, inputs.stages)


def test_fp8_plan_adds_the_e4m3_copies_and_their_scales_on_the_qwen2_5_0_5b_shape():
    c = preset_config("qwen2.5-0.5b")
    h, i, d = c.hidden_size, c.intermediate_size, c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    rows = q + 2 * kv + h + 2 * i + h  # output channels of q, k, v, o, gate, up, down
    codes = h * (q + 2 * kv) + q * h + 2 * i * h + i * h
    want = c.num_hidden_layers * (codes + 4 * rows)
    assert want == 24 * (14_909_440 + 4 * 12_672)  # Qwen2.5-0.5B: h 896, 14/2 heads of 64, I 4864, 24 layers

    plain, fp8 = _plan(*GRPO), _plan(*GRPO, "rollout.quantization=fp8")
    gen, gen0 = fp8.stage("generate").components, plain.stage("generate").components
    assert gen["rollout/fp8_weights"] == want and gen0["rollout/fp8_weights"] == 0
    # the copies are made before the KV cache is sized (gpu_memory_utilization of what is free then): fewer slots
    per_slot = gen0["rollout/kv_cache"] // plain.kv_slots
    kv_delta = gen0["rollout/kv_cache"] - gen["rollout/kv_cache"]
    assert plain.kv_slots < 100000 and 0.5 * want - per_slot <= kv_delta <= 0.5 * want + per_slot
    moved = ("rollout/fp8_weights", "rollout/kv_cache", "activations")  # activations: logits of min(rows, slots)
    assert {k: v for k, v in gen.items() if k not in moved} == {k: v for k, v in gen0.items() if k not in moved}
    assert fp8.notes and fp8.notes[0].startswith("rollout/fp8_weights: the e4m3 copies") and not plain.notes

    # released with the cache at the switch back to training (free_cache_engine), else kept through the step
    assert fp8.stage("update_actor").components["rollout/fp8_weights"] == 0
    kept = _plan(*GRPO, "rollout.quantization=fp8", "rollout.free_cache_engine=false")
    assert kept.stage("update_actor").components["rollout/fp8_weights"] == want


def test_fp8_weight_bytes_match_the_engine_stacks():
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    model = Qwen2ForCausalLM(cfg)
    fp8 = Fp8Weights()
    with torch.no_grad():
        fp8.quantize(WeightView(model, torch.float32, torch.device("cpu")).build())
    stacks = {k: v.numel() * v.element_size() for k, v in fp8._stacks.items() if k != "qkv_bias"}  # bias: not counted
    assert fp8_weight_bytes(ModelShape.from_hf(cfg.to_dict())) == sum(stacks.values())
