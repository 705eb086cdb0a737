"""Hybrid engine with LoRA (world size 1, gloo, fp32): the rollout generates from W + (alpha/r)·B·A merged into
copies of the adapted matrices only, and equals HF forward/generate of the model PEFT merges itself."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from peft import get_peft_model, set_peft_model_state_dict
from rollout_helpers import EOS, PAD, make_prompts
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from hybridflow.config import load_config
from hybridflow.engine import TrainEngine
from hybridflow.engine.lora import adapter_state_dict, peft_config
from hybridflow.models.loader import load_module
from hybridflow.rollout import RolloutEngine
from hybridflow.workers.engine_specs import actor_spec


@pytest.fixture(scope="module")
def lora_engine():
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = load_config([], ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj, v_proj, "
                           "gate_proj, down_proj]", "actor.ppo_mini_batch_size=8"])
    engine = TrainEngine(actor_spec(cfg), device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # adapters as after training: B is no longer zero
        for name, p in engine.module.named_parameters():
            if ".lora_B." in name:
                local = p.to_local() if hasattr(p, "to_local") else p
                local.copy_(torch.randn(local.shape, generator=g) * 0.3)
    yield cfg, engine
    if own:
        dist.destroy_process_group()


def _peft_merged(cfg, engine) -> torch.nn.Module:
    """Base model rebuilt from the preset + the engine's adapters, merged by PEFT (an independent W + s·B·A)."""
    base = load_module(cfg.model, "lm")
    peft_model = get_peft_model(base, peft_config(cfg.model.lora, engine.lora_targets))
    trained = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
               for k, v in get_model_state_dict(engine.module).items() if ".lora_" in k}
    result = set_peft_model_state_dict(peft_model, adapter_state_dict(trained))
    assert not result.unexpected_keys, result.unexpected_keys
    return peft_model.merge_and_unload().eval()


def test_rollout_equals_hf_of_the_merged_model(lora_engine):
    cfg, engine = lora_engine
    module = engine.module
    rollout = RolloutEngine(module, dataclasses.replace(cfg.rollout, free_cache_engine=False), eos_token_id=EOS,
                            pad_token_id=PAD, max_prompt_length=12, max_response_length=10)
    rollout.sync_weights()
    layer, w = module.model.layers[0], rollout._weights.layers[0]
    # adapted matrices are copies (q/k/v and gate/up then fused, as for any copy); the rest stay the training
    # parameters themselves, and the unadapted parts of a fused copy are W exactly
    assert w.o.data_ptr() == layer.self_attn.o_proj.weight.to_local().data_ptr()
    assert w.qkv is not None and w.q.data_ptr() != layer.self_attn.q_proj.weight.to_local().data_ptr()
    assert torch.equal(w.k, layer.self_attn.k_proj.weight.to_local())
    assert torch.equal(w.up, layer.mlp.up_proj.weight.to_local())

    merged = _peft_merged(cfg, engine)
    torch.testing.assert_close(w.q, merged.model.layers[0].self_attn.q_proj.weight, atol=1e-6, rtol=0)
    torch.testing.assert_close(w.down, merged.model.layers[0].mlp.down_proj.weight, atol=1e-6, rtol=0)

    prompts = make_prompts(5, 12, module.config.vocab_size, meta={"do_sample": False})
    out = rollout.generate(prompts)
    with torch.no_grad():
        ref = merged.generate(input_ids=prompts.batch["input_ids"], attention_mask=prompts.batch["attention_mask"],
                              max_new_tokens=10, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)[:, 12:]
        logits = merged(input_ids=out.batch["input_ids"], attention_mask=out.batch["attention_mask"],
                        position_ids=out.batch["position_ids"]).logits
    got = out.batch["responses"]
    assert torch.equal(got[:, : ref.shape[1]], ref), (got, ref)
    logp = torch.log_softmax(logits[:, 11:-1].float(), -1).gather(-1, got[..., None]).squeeze(-1)
    torch.testing.assert_close(out.batch["rollout_log_probs"], logp * out.batch["response_mask"], atol=1e-4, rtol=0)

    # a changed adapter is seen at the next switch (the delta is re-applied onto a fresh copy of W, not stacked)
    with torch.no_grad():
        b = layer.self_attn.q_proj.lora_B["default"].weight
        (b.to_local() if hasattr(b, "to_local") else b).mul_(2)
    rollout.sync_weights()
    merged2 = _peft_merged(cfg, engine)
    torch.testing.assert_close(rollout._weights.layers[0].q, merged2.model.layers[0].self_attn.q_proj.weight,
                               atol=1e-6, rtol=0)


def test_merge_in_bounded_stacks_equals_one_stack_per_shape(lora_engine, monkeypatch):
    """The batched LoRA merge stacks at most `weights.STACK_BYTES` of weights at a time; any chunking gives the
    weights of the unchunked merge (each matrix: W + s·B·A, one rounding)."""
    from hybridflow.rollout import weights as weights_mod

    cfg, engine = lora_engine
    whole = weights_mod.WeightView(engine.module, torch.float32, torch.device("cpu")).build()
    monkeypatch.setattr(weights_mod, "STACK_BYTES", 1)  # every stack one matrix: the per-matrix addmm_ path
    chunked = weights_mod.WeightView(engine.module, torch.float32, torch.device("cpu")).build()
    for a, b in zip(whole.tensors(), chunked.tensors()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert any(x.data_ptr() != y.data_ptr() for x, y in zip(whole.tensors(), chunked.tensors()))  # real copies
