"""The fused-norm decode composition (`DecodeOps.fuse_norms`: `mlp_block_norm` returns the next layer's normed
input, `qkv_normed` takes it) against the previous one (`qkv` + `mlp_block`, final norm outside): the same ops in
the same order, so on the CPU the logits, the KV cache and generated tokens are equal bit for bit — for the tiny
Llama, the small Qwen2 (fused q/k/v with bias) and a Qwen3 with q/k norms, over SDPA and the range-attention path,
for decode and the multi-turn `extend_ranged`; and GuardedCompile's eager fallback still gives the same."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from rollout_helpers import EOS, PAD, make_engine, make_model, make_prompts
from transformers import AutoModelForCausalLM, Qwen3Config

from hybridflow.rollout import forward
from hybridflow.rollout.decode_attention import decode_attention_ref
from hybridflow.utils.compile import GuardedCompile

P, STEPS = 10, 4


def model_of(kind: str) -> torch.nn.Module:
    if kind != "qwen3":
        return make_model(kind)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=24, max_position_embeddings=256, initializer_range=0.2,
                      pad_token_id=PAD, bos_token_id=2, eos_token_id=EOS, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(cfg).eval()


def run_decode(runner, ops, B: int = 4, seed: int = 1):
    """Prefill B prompts, then STEPS decode steps through `ops`; (logits per step, the cache's K and V). On the
    runner's device (the inputs are made on the CPU and moved)."""
    cache = copy.deepcopy(runner.cache)
    vocab, dev = runner.spec.vocab, runner.weights.embed.device
    prompts = make_prompts(B, P, vocab, seed=seed)
    ids, mask = prompts.batch["input_ids"].to(dev), prompts.batch["attention_mask"].to(dev)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    slots = torch.arange(B, device=dev)
    new = torch.randint(3, vocab, (B, STEPS), generator=torch.Generator().manual_seed(seed + 1)).to(dev)
    T = cache.max_len
    valid = torch.zeros(B, T, dtype=torch.bool, device=dev)
    valid[:, :P] = mask.bool()
    start = P - mask.sum(-1)
    with torch.no_grad():
        out = [forward.prefill(runner.weights, runner.spec, runner.rope, ids, mask, pos, cache, slots, slots)]
        for s in range(STEPS):
            out.append(forward.decode(runner.weights, runner.spec, runner.rope, ops, new[:, s], pos[:, -1] + 1 + s,
                                      torch.full((B,), P + s, device=dev), valid, start, cache, T))
    return torch.stack(out, 1), cache.k, cache.v


def assert_same(a, b):
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(x, y) for x, y in zip(a[1] + a[2], b[1] + b[2]))


@pytest.mark.parametrize("kind", ["tiny", "qwen", "qwen3"])
@pytest.mark.parametrize("ranged", [False, True], ids=["sdpa", "range-attention"])
def test_fused_norm_decode_equals_previous_composition(kind, ranged):
    runner = make_engine(model_of(kind), P, 6)._prepare()
    assert runner.ops.fuse_norms
    if kind == "qwen3":
        assert runner.weights.layers[0].q_norm is not None
    ops = forward.DecodeOps(attention=decode_attention_ref if ranged else None)
    fused = run_decode(runner, ops)
    old = run_decode(runner, dataclasses.replace(ops, fuse_norms=False))
    assert fused[0].abs().max() > 0.5
    assert_same(fused, old)


@pytest.mark.parametrize("kind", ["tiny", "qwen3"])
def test_fused_norm_extend_ranged_equals_previous_composition(kind):
    runner = make_engine(model_of(kind), P, 6)._prepare()
    ops = forward.DecodeOps(attention=decode_attention_ref)
    g = torch.Generator().manual_seed(5)
    N = 7
    ids = torch.randint(3, runner.spec.vocab, (N,), generator=g)
    slot = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    col = torch.tensor([3, 4, 5, 0, 1, 6, 7])
    start = torch.tensor([0, 0, 0, 0, 0, 2, 2])
    last = torch.tensor([2, 4, 6])
    outs = []
    for o in (ops, dataclasses.replace(ops, fuse_norms=False)):
        cache = copy.deepcopy(runner.cache)
        with torch.no_grad():
            logits = forward.extend_ranged(runner.weights, runner.spec, runner.rope, o, ids, col, slot, col, start,
                                           last, cache)
        outs.append((logits, cache.k, cache.v))
    assert_same(*outs)


def test_engine_generates_the_same_with_either_composition():
    model = make_model("qwen")
    prompts = make_prompts(6, 12, model.config.vocab_size, seed=3, meta={"n": 2, "seeds": list(range(6))})
    outs = []
    for fuse in (True, False):
        engine = make_engine(model, max_num_seqs=8, enforce_eager=True)
        runner = engine._prepare()
        runner.ops = dataclasses.replace(runner.ops, fuse_norms=fuse)
        outs.append(engine.generate(prompts))
        assert engine._runner.ops.fuse_norms is fuse
    assert torch.equal(outs[0].batch["responses"], outs[1].batch["responses"])
    assert torch.equal(outs[0].batch["rollout_log_probs"], outs[1].batch["rollout_log_probs"])


def test_guarded_compile_fallback_keeps_the_fused_composition_equal(monkeypatch):
    """Every fused-norm piece behind a GuardedCompile whose compile fails: each falls back to eager once and the
    decode still equals the previous composition."""
    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("inductor exploded")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    runner = make_engine(model_of("qwen3"), P, 6)._prepare()
    guarded = forward.DecodeOps(qkv_normed=GuardedCompile(forward.qkv_normed, "qkv_normed"),
                                mlp_block_norm=GuardedCompile(forward.mlp_block_norm, "mlp_block_norm"),
                                embed_norm=GuardedCompile(forward.embed_norm, "embed_norm"))
    fused = run_decode(runner, guarded)
    assert not (guarded.qkv_normed.ok or guarded.mlp_block_norm.ok or guarded.embed_norm.ok)
    assert_same(fused, run_decode(runner, forward.DecodeOps(fuse_norms=False)))
