"""The GPU fast paths checked on CPU against the plain ones: fused q/k/v and gate/up buffers, the per-row
column-range attention (the Triton kernel's contract, run here through its torch reference), the Gumbel sampler's
batch invariance, and torch.compile failures falling back to eager once per process."""

from __future__ import annotations

import logging

import pytest
import torch
from rollout_helpers import make_engine, make_model, make_prompts

from hybridflow.rollout import forward
from hybridflow.rollout.decode_attention import decode_attention_ref
from hybridflow.rollout.sampling import SamplingParams, row_seed, sample, sampler_values


@pytest.mark.parametrize("kind", ["tiny", "qwen"])
def test_fused_cast_buffers_generate_like_unfused_views(kind):
    model = make_model(kind).double()  # fp64 parameters, fp32 generation: every view is a cast copy
    prompts = make_prompts(6, 12, model.config.vocab_size, meta={"n": 2, "seeds": list(range(6))})
    fused = make_engine(model)
    fused._dtype_arg = torch.float32
    fused.bind(model)
    out = fused.generate(prompts)
    lw = fused._weights.layers[0]
    assert lw.qkv is not None and lw.gate_up is not None
    assert lw.q.data_ptr() == lw.qkv.data_ptr() and lw.gate.data_ptr() == lw.gate_up.data_ptr()
    assert (lw.qkv_bias is not None) == (model.model.layers[0].self_attn.q_proj.bias is not None)
    ref_model = make_model(kind)  # the same weights in fp32: zero-copy, unfused
    plain = make_engine(ref_model)
    ref = plain.generate(prompts)
    assert plain._weights.layers[0].qkv is None
    assert torch.equal(out.batch["responses"], ref.batch["responses"])
    torch.testing.assert_close(out.batch["rollout_log_probs"], ref.batch["rollout_log_probs"], atol=1e-5, rtol=0)


def test_range_attention_equals_masked_sdpa(monkeypatch):
    model = make_model("qwen")
    prompts = make_prompts(9, 12, model.config.vocab_size, seed=3, meta={"n": 3, "seeds": list(range(9))})
    sdpa = make_engine(model, max_num_seqs=8).generate(prompts)  # 27 rows through 8 slots: slots are reused
    monkeypatch.setattr(forward, "_triton_attention", lambda device: decode_attention_ref)
    engine = make_engine(model, max_num_seqs=8)
    ranged = engine.generate(prompts)
    assert engine._runner.ops.attention is decode_attention_ref
    assert torch.equal(ranged.batch["responses"], sdpa.batch["responses"])
    torch.testing.assert_close(ranged.batch["rollout_log_probs"], sdpa.batch["rollout_log_probs"],
                               atol=1e-5, rtol=0)


def test_gumbel_sampler_is_batch_invariant_and_skips_masked_tokens():
    logits = torch.randn(64, 50)
    logits[:, 7] = float("-inf")
    params = SamplingParams(temperature=0.8)
    temp, k, p = (torch.tensor(v) for v in sampler_values(params, 50))
    seeds = torch.tensor([row_seed(5, i) for i in range(64)])
    steps = torch.arange(64) % 5
    tok, logp = sample(logits, "sample", temp, k, p, seeds, steps)
    sub_tok, sub_logp = sample(logits[10:20], "sample", temp, k, p, seeds[10:20], steps[10:20])
    assert torch.equal(sub_tok, tok[10:20]) and torch.equal(sub_logp, logp[10:20])
    assert (tok != 7).all()
    torch.testing.assert_close(logp, torch.log_softmax(logits / 0.8, -1).gather(-1, tok[:, None]).squeeze(-1))


def test_compile_failure_falls_back_once(monkeypatch, caplog):
    calls = []

    def broken_compile(fn, **kwargs):
        def run(*args):
            calls.append(1)
            raise RuntimeError("inductor exploded")
        return run

    monkeypatch.setattr(forward.torch, "compile", broken_compile)
    op = forward.GuardedCompile(lambda x: x + 1, "test op")
    with caplog.at_level(logging.WARNING):
        assert op(torch.ones(2)).tolist() == [2.0, 2.0]
        assert op(torch.ones(2)).tolist() == [2.0, 2.0]
    assert len(calls) == 1 and not op.ok
    assert caplog.text.count("torch.compile of test op failed (RuntimeError: inductor exploded)") == 1


def test_guarded_compile_lets_out_of_memory_through(monkeypatch):
    """Out of memory is the workload's problem, not the compiler's: it is raised, and compiling is not given up."""
    def oom_compile(fn, **kwargs):
        def run(*args):
            raise torch.OutOfMemoryError("CUDA out of memory")
        return run

    monkeypatch.setattr(forward.torch, "compile", oom_compile)
    op = forward.GuardedCompile(lambda x: x + 1, "test op")
    with pytest.raises(torch.OutOfMemoryError):
        op(torch.ones(2))
    assert op.ok


def test_right_padded_prompts_are_refused_with_the_row():
    model = make_model("tiny")
    prompts = make_prompts(3, 8, model.config.vocab_size)
    prompts.batch["attention_mask"][2] = torch.tensor([1, 1, 1, 1, 1, 0, 0, 0])
    with pytest.raises(ValueError, match="prompt row 2 is not left-padded"):
        make_engine(model, 8, 4).generate(prompts)
