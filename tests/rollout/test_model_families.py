"""Per-family logit parity against transformers, tiny random configs in fp32 on the CPU.

For every model type in `SUPPORTED_MODEL_TYPES`: (a) our rollout forward — prefill of left-padded prompts, then
several decode steps through the KV cache — against one HF forward of the whole rows, and a sampled generate's
log-probs against HF's recomputation; (b) the training forward (`TrainEngine.infer`, FSDP2 on one gloo rank)
against the same HF recomputation. Gemma-2 (outside it), Phi-3 and Gemma-3 train one step and generate, Gemma-2
through the HF fallback, which warns once (with the reason) that generation is slow.
"""

from __future__ import annotations

import logging

import pytest
import torch
from rollout_helpers import EOS, PAD, assert_greedy_equals_hf, make_engine, make_prompts, rollout_cfg
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from hybridflow.config import load_config
from hybridflow.engine import HeadRequest, TrainEngine, UpdatePlan, train_update
from hybridflow.models.tokenizer import _vocab, save_builtin_tokenizer
from hybridflow.rollout import RolloutEngine, forward
from hybridflow.rollout.decode_attention import decode_attention_ref
from hybridflow.rollout.kv_store_kernel import store_kv_ref
from hybridflow.rollout.weights import SUPPORTED_MODEL_TYPES, WeightView, check_parallel, unsupported_reason
from hybridflow.workers.engine_specs import actor_spec

VOCAB = len(_vocab())  # the built-in tokenizer's, so a saved model directory loads with it
P, R, DECODE_STEPS = 10, 6, 5
ATOL = 1e-4
_SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, pad_token_id=PAD,
              bos_token_id=2, eos_token_id=EOS)

# Llama-3 RoPE scaling only changes frequencies whose wavelength exceeds original_max_position_embeddings /
# low_freq_factor; 16 with head_dim 16 and theta 10000 puts the cut inside the tiny head, so it really acts.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 10000.0}

FAMILIES = {
    "llama3-rope": lambda: LlamaConfig(**_SMALL, rope_scaling=LLAMA3_ROPE),
    "llama-bias-tied": lambda: LlamaConfig(**_SMALL, attention_bias=True, tie_word_embeddings=True),
    "qwen2": lambda: Qwen2Config(**_SMALL, tie_word_embeddings=True),
    # head_dim 24 != hidden / heads = 16: the q/k norms and RoPE run over an explicit head_dim
    "qwen3": lambda: Qwen3Config(**_SMALL, head_dim=24, tie_word_embeddings=False),
    "mistral": lambda: MistralConfig(**_SMALL, sliding_window=4096),  # window wider than the rows: full attention
    # fused qkv_proj / gate_up_proj in the module: the engine reads q/k/v and gate/up as row views of them
    "phi3": lambda: Phi3Config(**_SMALL, sliding_window=4096),
    # (1 + w) norms around attention and MLP, GELU-tanh, embedding x sqrt(hidden), attention scaled by
    # query_pre_attn_scalar**-0.5 (not head_dim's), a local RoPE base on the sliding layer (window wider than the rows)
    "gemma3_text": lambda: Gemma3TextConfig(**_SMALL, head_dim=16, query_pre_attn_scalar=24, sliding_window=4096,
                                            layer_types=["sliding_attention", "full_attention"]),
    # MoE: 8 experts, 2 per token (rollout/moe.py); Qwen2-MoE adds a gated shared expert and a dense layer
    "qwen3_moe": lambda: Qwen3MoeConfig(**_SMALL, head_dim=16, moe_intermediate_size=32, num_experts=8,
                                        num_experts_per_tok=2, norm_topk_prob=True),
    "mixtral": lambda: MixtralConfig(**_SMALL, num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": lambda: Qwen2MoeConfig(**_SMALL, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                        shared_expert_intermediate_size=48, norm_topk_prob=False,
                                        mlp_only_layers=[1]),
}
FALLBACK = {
    "gemma2": lambda: Gemma2Config(**_SMALL, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
}


def test_every_supported_type_is_covered():
    covered = {FAMILIES[name]().model_type for name in FAMILIES}
    assert covered == set(SUPPORTED_MODEL_TYPES), (covered, SUPPORTED_MODEL_TYPES)


def make_family(name: str, seed: int = 0) -> torch.nn.Module:
    cfg = (FAMILIES | FALLBACK)[name]()
    cfg._attn_implementation = "eager"  # the reference: HF's plain attention, nothing fused
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # norms start at ones (zeros for Gemma): randomise them so q/k norms etc. really count
        for name_, p in model.named_parameters():
            if "norm" in name_:
                p.uniform_(0.5, 1.5) if p.abs().sum() > 0 else p.uniform_(-0.5, 0.5)
            elif name_.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model


def hf_logits(model, ids, mask, pos) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()


def hf_response_logprobs(model, out, temperature: float = 1.0) -> torch.Tensor:
    b = out.batch
    logits = hf_logits(model, b["input_ids"], b["attention_mask"], b["position_ids"])
    Pw = b["prompts"].shape[1]
    logp = torch.log_softmax(logits[:, Pw - 1:-1] / temperature, dim=-1)
    return logp.gather(-1, b["responses"][..., None]).squeeze(-1) * b["response_mask"]


# ------------------------------------------------------------------------------- (a) rollout forward parity
# decode through SDPA, or through the torch references of the GPU kernels (K/V store and range attention, RoPE
# applied inside them from each row's cos/sin: the per-layer tables and the attention scale cross their interface)
DECODE_OPS = {"sdpa": forward.EAGER_OPS,
              "kernel-refs": forward.DecodeOps(attention=decode_attention_ref, kv_store=store_kv_ref)}


@pytest.mark.parametrize("decode_ops", sorted(DECODE_OPS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rollout_prefill_and_decode_logits_match_hf(family, decode_ops):
    model = make_family(family)
    engine = make_engine(model, P, R)
    assert engine._fallback is None and engine.uses_hf_fallback is False, f"{family} fell back to HF generate"
    runner = engine._prepare()
    ops = DECODE_OPS[decode_ops]
    prompts = make_prompts(3, P, VOCAB, seed=1)
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    B = ids.shape[0]
    slots = torch.arange(B)
    new = torch.randint(3, VOCAB, (B, DECODE_STEPS), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = [forward.prefill(runner.weights, runner.spec, runner.rope, ids, mask, pos, runner.cache, slots, slots)]
        T = runner.cache.max_len
        valid = torch.zeros(B, T, dtype=torch.bool)
        valid[:, :P] = mask.bool()
        start = P - mask.sum(-1)
        for s in range(DECODE_STEPS):
            ours.append(forward.decode(runner.weights, runner.spec, runner.rope, ops, new[:, s],
                                       pos[:, -1] + 1 + s, torch.full((B,), P + s), valid, start, runner.cache, T))
    ours_t = torch.stack(ours, 1).float()  # [B, 1 + steps, V]
    full_ids = torch.cat([ids, new], 1)
    full_mask = torch.cat([mask, torch.ones_like(new)], 1)
    full_pos = torch.cat([pos, pos[:, -1:] + 1 + torch.arange(DECODE_STEPS)[None]], 1)
    ref = hf_logits(model, full_ids, full_mask, full_pos)[:, P - 1:]
    assert ref.abs().max() > 0.5  # logits that carry signal
    torch.testing.assert_close(ours_t, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours_t.log_softmax(-1), ref.log_softmax(-1), atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rollout_greedy_tokens_match_hf_generate(family):
    model = make_family(family)
    prompts = make_prompts(3, P, VOCAB, seed=6, meta={"do_sample": False})
    engine = make_engine(model, P, R)
    out = engine.generate(prompts)
    assert not engine.uses_hf_fallback, family
    assert_greedy_equals_hf(model, prompts, out, R)


def test_llama3_rope_scaling_is_active():
    """Guard for the parity test above: the tiny Llama-3 config really rescales some RoPE frequencies."""
    scaled, plain = make_family("llama3-rope"), make_family("llama-bias-tied")
    a, b = scaled.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq
    assert a.shape == b.shape and not torch.allclose(a, b)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_rollout_sampled_logprobs_match_hf(family):
    model = make_family(family)
    engine = make_engine(model, P, R)
    out = engine.generate(make_prompts(3, P, VOCAB, seed=3, meta={"n": 2, "temperature": 0.9}))
    assert out.batch["response_mask"].sum() > 0 and not engine.uses_hf_fallback
    torch.testing.assert_close(out.batch["rollout_log_probs"], hf_response_logprobs(model, out, 0.9),
                               atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------ (b) training forward parity
def train_engine_for(model, tmp_path, *overrides: str) -> TrainEngine:
    """The actor's FSDP2 engine loading `model` from a directory (with the built-in tokenizer beside it)."""
    model.save_pretrained(tmp_path)
    save_builtin_tokenizer(tmp_path)
    cfg = load_config([], [f"model.path={tmp_path}", "data.train_batch_size=6", "actor.ppo_mini_batch_size=6", "actor.optim.lr=1e-2",
                           "actor.ppo_micro_batch_size_per_gpu=6", "actor.grad_clip=1e6", *overrides])
    return TrainEngine(actor_spec(cfg), device="cpu")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_training_forward_logprobs_match_hf(family, gloo, tmp_path):
    model = make_family(family)
    out = make_engine(model, P, R).generate(make_prompts(3, P, VOCAB, seed=4, meta={"n": 2}))
    engine = train_engine_for(model, tmp_path)
    ours = engine.infer(out, HeadRequest("lm", temperature=1.0))["log_probs"] * out.batch["response_mask"]
    ref = hf_response_logprobs(model, out)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours, out.batch["rollout_log_probs"], atol=ATOL, rtol=0)


# ---------------------------------------------------------------------- families behind the HF fallback
def _push_up(outputs, micro, norm):
    return -(outputs["log_probs"] * micro.batch["response_mask"]).sum() / norm["token-mean"], {}


@pytest.mark.parametrize("family", [*sorted(FALLBACK), "phi3", "gemma3_text"])
def test_family_trains_one_step_and_generates(family, gloo, tmp_path, caplog):
    model = make_family(family)
    engine = train_engine_for(model, tmp_path)
    with caplog.at_level(logging.WARNING, logger="hybridflow.rollout.hf_fallback"):
        rollout = RolloutEngine(engine.module, rollout_cfg(free_cache_engine=False), eos_token_id=EOS,
                                pad_token_id=PAD, max_prompt_length=P, max_response_length=R)
        prompts = make_prompts(3, P, VOCAB, seed=5, meta={"n": 2, "seeds": [1, 2, 3]})
        out = rollout.generate(prompts)
        rollout.generate(prompts)
    slow = [r for r in caplog.records if "slow" in r.getMessage()]
    fallback = family in FALLBACK
    assert rollout.uses_hf_fallback is fallback and len(slow) == fallback, [r.getMessage() for r in caplog.records]
    if fallback:
        assert "\n" not in slow[0].getMessage() and family.split("_")[0] in slow[0].getMessage()
    b = out.batch
    assert b["responses"].shape == (6, R) and b["response_mask"].sum() > 0
    before = engine.infer(out, HeadRequest("lm", temperature=1.0))["log_probs"] * b["response_mask"]
    # the fallback's log-probs (HF generate's scores) agree with the training forward on the same rows
    torch.testing.assert_close(b["rollout_log_probs"], before, atol=ATOL, rtol=0)
    # ... and with HF's eager forward of the original model (Gemma-2: attention and final-logit soft-capping;
    # Gemma-2/3: sliding-window layers shorter than the packed rows)
    torch.testing.assert_close(before, hf_response_logprobs(model, out), atol=ATOL, rtol=0)
    train_update(engine, out, _push_up, HeadRequest("lm", temperature=1.0), UpdatePlan(6))
    after = engine.infer(out, HeadRequest("lm", temperature=1.0))["log_probs"] * b["response_mask"]
    assert torch.isfinite(after).all()
    assert (after - before).sum() > 0  # one step pushed the sampled responses up
    again = rollout.generate(prompts)  # generation reads the updated weights
    assert again.batch["responses"].shape == (6, R)


# --------------------------------------------------------------------------------- Phi-3's fused projections
def test_phi3_fused_projections_are_row_views():
    """Zero copy: q/k/v and gate/up are row views of the module's qkv_proj / gate_up_proj (no second copy). Cast
    (bf16 generation from fp32): one fused buffer per projection, refreshed in place at the next build."""
    model = make_family("phi3")
    att, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    lw = WeightView(model, torch.float32, torch.device("cpu")).build().layers[1]
    assert lw.qkv.data_ptr() == att.qkv_proj.weight.data_ptr()
    assert lw.gate_up.data_ptr() == mlp.gate_up_proj.weight.data_ptr()
    q_rows, kv_rows = 4 * 16, 2 * 16
    torch.testing.assert_close(torch.cat([lw.q, lw.k, lw.v]), att.qkv_proj.weight, atol=0, rtol=0)
    assert lw.k.data_ptr() == att.qkv_proj.weight[q_rows].data_ptr() and lw.v.shape[0] == kv_rows
    torch.testing.assert_close(lw.up, mlp.gate_up_proj.weight[96:], atol=0, rtol=0)
    view = WeightView(model, torch.bfloat16, torch.device("cpu"))
    lw = view.build().layers[1]
    ptr = lw.qkv.data_ptr()
    with torch.no_grad():
        att.qkv_proj.weight.mul_(2)
    lw = view.build().layers[1]
    assert lw.qkv.data_ptr() == ptr and lw.k.data_ptr() == lw.qkv[q_rows].data_ptr()
    torch.testing.assert_close(lw.k.float(), att.qkv_proj.weight[q_rows: q_rows + kv_rows], atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("rope", [{"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                   "original_max_position_embeddings": 64, "rope_theta": 10000.0},
                                  {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}],
                         ids=["longrope", "partial"])
def test_phi3_other_rope_falls_back_naming_the_value(rope):
    cfg = Phi3Config(**_SMALL, rope_parameters=rope)
    reason = unsupported_reason(AutoModelForCausalLM.from_config(cfg), P + R)
    assert reason is not None and "rope_parameters=" in reason, reason
    assert ("'longrope'" if rope["rope_type"] == "longrope" else "partial_rotary_factor 0.5") in reason


def test_phi3_refuses_tensor_parallel():
    model = make_family("phi3")
    check_parallel(model, rollout_cfg(tensor_model_parallel_size=1))
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2 with phi3"):
        check_parallel(model, rollout_cfg(tensor_model_parallel_size=2))


# ------------------------------------------------------------------------------------------------- Gemma-3
def in_bf16(p: torch.Tensor) -> torch.Tensor:
    return 1 + p.detach().bfloat16().float()


def test_gemma3_norms_are_one_plus_w_in_fp32_and_replays_refresh_them():
    """Gemma's norms scale by 1 + w.float(): under bf16 generation the views hold 1 + bf16(w) in fp32 (what the
    model computes in bf16, e.g. the training forward with bf16 parameters), and a replayed build (`build_plan`)
    recomputes it from the updated parameter."""
    model = make_family("gemma3_text")
    layer = model.model.layers[0]
    view = WeightView(model, torch.bfloat16, torch.device("cpu"))
    w = view.build()
    assert w.layers[0].ln1.dtype == torch.float32 and w.layers[0].q.dtype == torch.bfloat16
    assert not torch.equal(in_bf16(model.model.norm.weight), 1 + model.model.norm.weight)  # the rounding counts
    torch.testing.assert_close(w.layers[0].post_mlp_norm, in_bf16(layer.post_feedforward_layernorm.weight), atol=0,
                               rtol=0)
    torch.testing.assert_close(w.norm, in_bf16(model.model.norm.weight), atol=0, rtol=0)
    with torch.no_grad():
        layer.self_attn.k_norm.weight.add_(0.25)
    again = view.build()
    assert view._plan is not None and again is w  # the replay: the same views, refreshed
    torch.testing.assert_close(again.layers[0].k_norm, in_bf16(layer.self_attn.k_norm.weight), atol=0, rtol=0)


@pytest.mark.parametrize("change,expect", [(dict(attn_logit_softcapping=50.0), "soft-capped"),
                                           (dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
                                           (dict(sliding_window=4), "sliding-window attention (window 4"),
                                           (dict(use_bidirectional_attention=True), "use_bidirectional_attention")])
def test_gemma3_variants_the_engine_does_not_compute_fall_back(change, expect):
    cfg = FAMILIES["gemma3_text"]()
    for key, value in change.items():
        setattr(cfg, key, value)
    reason = unsupported_reason(AutoModelForCausalLM.from_config(cfg), P + R)
    assert reason is not None and expect in reason, reason
