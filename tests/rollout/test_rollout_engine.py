"""RolloutEngine against naive references: HF generate (greedy) and an HF forward recomputing log-probs."""

from __future__ import annotations

import logging

import numpy as np
import torch
from rollout_helpers import (
    EOS,
    PAD,
    assert_greedy_equals_hf,
    make_engine,
    make_model,
    make_prompts,
    rollout_cfg,
)
from transformers import GPT2Config, GPT2LMHeadModel

from hybridflow.rollout import RolloutEngine, SamplingParams


def hf_logprobs(model, out, temperature: float) -> torch.Tensor:
    """Log-prob of each response token under softmax(logits / T) from one plain HF forward of the full rows."""
    P = out.batch["prompts"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=out.batch["input_ids"], attention_mask=out.batch["attention_mask"],
                       position_ids=out.batch["position_ids"]).logits
    logp = torch.log_softmax(logits[:, P - 1:-1].float() / temperature, dim=-1)
    return logp.gather(-1, out.batch["responses"][..., None]).squeeze(-1) * out.batch["response_mask"]


def test_greedy_matches_hf_generate(model):
    P, R = 12, 10
    prompts = make_prompts(5, P, model.config.vocab_size, meta={"do_sample": False})
    out = make_engine(model, P, R).generate(prompts)
    assert_greedy_equals_hf(model, prompts, out, R)


def test_sampled_logprobs_equal_recomputation(model):
    prompts = make_prompts(4, 12, model.config.vocab_size, meta={"n": 3, "temperature": 0.7})
    out = make_engine(model).generate(prompts)
    ref = hf_logprobs(model, out, 0.7)
    torch.testing.assert_close(out.batch["rollout_log_probs"], ref, atol=1e-4, rtol=0)
    # Sampling happened: the 3 samples of a prompt are not all identical.
    assert not torch.equal(out.batch["responses"][0], out.batch["responses"][1]) or \
        not torch.equal(out.batch["responses"][0], out.batch["responses"][2])


def test_output_layout_and_non_tensor_repeat():
    model = make_model("tiny")
    prompts = make_prompts(3, 8, model.config.vocab_size, meta={"n": 2})
    prompts.non_tensor_batch["uid"] = np.array(["a", "b", "c"], dtype=object)
    out = make_engine(model, 8, 6).generate(prompts)
    b = out.batch
    assert b["responses"].shape == (6, 6) and b["input_ids"].shape == (6, 14)
    assert list(out.non_tensor_batch["uid"]) == ["a", "a", "b", "b", "c", "c"]
    assert torch.equal(b["prompts"], prompts.batch["input_ids"].repeat_interleave(2, 0))
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], 1))
    assert torch.equal(b["attention_mask"][:, 8:], b["response_mask"])
    last = prompts.batch["position_ids"][:, -1].repeat_interleave(2)
    assert torch.equal(b["position_ids"][:, 8:], last[:, None] + torch.arange(1, 7)[None])
    # response_mask is a prefix of ones; pads and zero log-probs after it
    m = b["response_mask"]
    assert torch.equal(m, m.cummin(dim=1).values)
    assert (b["responses"][m == 0] == PAD).all() and (b["rollout_log_probs"][m == 0] == 0).all()


def test_same_seed_same_output_regardless_of_batch():
    model = make_model("qwen")
    prompts = make_prompts(6, 10, model.config.vocab_size, seed=3)
    engine = make_engine(model, 10, 8)
    seeds = [11, 22, 33, 44, 55, 66]
    full = engine.generate(prompts.__class__.from_single_dict(dict(prompts.batch), meta_info={"seeds": seeds}))
    order = [4, 1]
    sub = prompts.select_idxs(order)
    sub.meta_info = {"seeds": [seeds[i] for i in order]}
    part = engine.generate(sub)
    assert torch.equal(part.batch["responses"], full.batch["responses"][order])
    torch.testing.assert_close(part.batch["rollout_log_probs"], full.batch["rollout_log_probs"][order])
    other = make_prompts(6, 10, model.config.vocab_size, seed=3, meta={"seeds": [s + 1 for s in seeds]})
    assert not torch.equal(engine.generate(other).batch["responses"], full.batch["responses"])


def test_continuous_batching_equals_one_at_a_time():
    model = make_model("qwen")
    prompts = make_prompts(7, 10, model.config.vocab_size, seed=5, meta={"n": 2, "seeds": list(range(7))})
    # 5 slots for 14 samples: requests wait, enter freed slots; EOS in the stop set makes lengths vary.
    few = make_engine(model, 10, 12, max_num_seqs=5, stop_token_ids=[7, 8, 9, 10, 11]).generate(prompts)
    lengths = few.batch["response_mask"].sum(1)
    assert lengths.min() < 12 and few.meta_info["metrics"]["rollout/prefills"] > 1, lengths
    single = make_engine(model, 10, 12, stop_token_ids=[7, 8, 9, 10, 11])
    for i in range(7):
        one = prompts.select_idxs([i])
        one.meta_info = {"n": 2, "seeds": [i]}
        got = single.generate(one)
        assert torch.equal(got.batch["responses"], few.batch["responses"][2 * i: 2 * i + 2]), i
        torch.testing.assert_close(got.batch["rollout_log_probs"], few.batch["rollout_log_probs"][2 * i: 2 * i + 2],
                                   atol=1e-4, rtol=0)


def test_stop_tokens_and_eos():
    model = make_model("tiny")
    prompts = make_prompts(6, 8, model.config.vocab_size, seed=1, meta={"n": 4})
    stops = list(range(3, 40))  # frequent stop ids so most rows stop early
    out = make_engine(model, 8, 10, stop_token_ids=stops).generate(prompts)
    resp, m = out.batch["responses"], out.batch["response_mask"]
    lengths = m.sum(1)
    assert (lengths < 10).any()
    for row, n in zip(resp, lengths.tolist()):
        body = row[:n].tolist()
        assert all(t not in stops and t != EOS for t in body[:-1])
        if n < 10:
            assert body[-1] in stops or body[-1] == EOS
        assert (row[n:] == PAD).all()
    # ignore_eos keeps going through EOS but stop_token_ids still stop; without stops every row is full length
    full = make_engine(model, 8, 10, ignore_eos=True).generate(prompts)
    assert (full.batch["response_mask"].sum(1) == 10).all()


def test_eos_stops_generation():
    model = make_model("tiny")
    prompts = make_prompts(4, 8, model.config.vocab_size, meta={"do_sample": False})
    free = make_engine(model, 8, 8, ignore_eos=True).generate(prompts).batch["responses"]
    eos = int(free[0, 2])  # a token greedy decoding emits: declare it the EOS id
    engine = RolloutEngine(model, rollout_cfg(free_cache_engine=False), eos_token_id=eos, pad_token_id=PAD,
                           max_prompt_length=8, max_response_length=8)
    out = engine.generate(prompts).batch
    for row_free, row, n in zip(free, out["responses"], out["response_mask"].sum(1).tolist()):
        hits = (row_free == eos).nonzero()
        expect = int(hits[0]) + 1 if len(hits) else 8
        assert n == expect and torch.equal(row[:n], row_free[:n]) and (row[n:] == PAD).all(), (row_free, row)
    assert out["response_mask"][0].sum() == 3


def test_n_samples_prefix_sharing_equals_independent_prefills():
    model = make_model("qwen")
    prompts = make_prompts(3, 10, model.config.vocab_size, seed=2)
    row_seeds = list(range(100, 112))
    shared = prompts.select_idxs([0, 1, 2])
    shared.meta_info = {"n": 4, "seeds": row_seeds}  # one seed per output row
    a = make_engine(model, 10, 8).generate(shared)
    rep = prompts.repeat(4, interleave=True)
    rep.meta_info = {"n": 1, "seeds": row_seeds}
    b = make_engine(model, 10, 8).generate(rep)
    assert a.meta_info["metrics"]["rollout/prefills"] == 1
    assert torch.equal(a.batch["responses"], b.batch["responses"])
    torch.testing.assert_close(a.batch["rollout_log_probs"], b.batch["rollout_log_probs"], atol=1e-5, rtol=0)


def test_weight_update_changes_next_generation():
    model = make_model("tiny")
    engine = make_engine(model, 8, 8)
    prompts = make_prompts(4, 8, model.config.vocab_size, meta={"do_sample": False})
    before = engine.generate(prompts).batch["responses"]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    target = (before + 1) % model.config.vocab_size  # a deliberate update towards other tokens
    logits = model(input_ids=torch.cat([prompts.batch["input_ids"], target], 1)).logits[:, 7:-1]
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)).backward()
    opt.step()
    engine.sync_weights()
    after = engine.generate(prompts)
    assert not torch.equal(after.batch["responses"], before)
    with torch.no_grad():
        ref = model.generate(input_ids=prompts.batch["input_ids"], attention_mask=prompts.batch["attention_mask"],
                             max_new_tokens=8, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)[:, 8:]
    assert torch.equal(after.batch["responses"][:, : ref.shape[1]], ref)


def test_zero_copy_views_and_cast_buffers():
    model = make_model("tiny")
    engine = make_engine(model)
    engine.sync_weights()
    assert engine._weights.embed.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert not engine._weights.owned_buffers
    bf = make_engine(model)
    bf._dtype_arg = torch.bfloat16
    bf.bind(model)
    bf.sync_weights()
    assert bf._weights.embed.dtype == torch.bfloat16 and bf._weights.owned_buffers
    ptr = bf._weights.layers[0].q.data_ptr()
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(2)
    bf.sync_weights()  # reused buffer, refreshed values
    assert bf._weights.layers[0].q.data_ptr() == ptr
    torch.testing.assert_close(bf._weights.layers[0].q.float(), model.model.layers[0].self_attn.q_proj.weight,
                               atol=1e-2, rtol=1e-2)


def test_val_kwargs_greedy_by_default():
    model = make_model("tiny")
    prompts = make_prompts(3, 8, model.config.vocab_size, meta={"validate": True})
    engine = make_engine(model, 8, 6)
    a, b = engine.generate(prompts), engine.generate(prompts)
    assert torch.equal(a.batch["responses"], b.batch["responses"])  # greedy: no dependence on the call counter
    assert engine.sampling_for({"validate": True}, None) == SamplingParams(
        n=1, temperature=1.0, do_sample=False, seed=0)


def test_unsupported_architecture_falls_back_to_hf(caplog):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64)).eval()
    with caplog.at_level(logging.WARNING):
        engine = make_engine(model, 8, 6)
    assert "model_type='gpt2'" in caplog.text
    prompts = make_prompts(3, 8, 100, meta={"n": 2, "temperature": 0.8})
    out = engine.generate(prompts)
    assert out.batch["responses"].shape == (6, 6)
    ref = hf_logprobs(model, out, 0.8)
    torch.testing.assert_close(out.batch["rollout_log_probs"], ref, atol=1e-4, rtol=0)


def test_top_k_top_p_logprobs_equal_hf_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )
    model = make_model("qwen")
    prompts = make_prompts(4, 10, model.config.vocab_size, meta={"n": 2, "temperature": 0.9, "top_k": 20,
                                                                 "top_p": 0.8})
    out = make_engine(model, 10, 8).generate(prompts)
    P = 10
    with torch.no_grad():
        logits = model(input_ids=out.batch["input_ids"], attention_mask=out.batch["attention_mask"],
                       position_ids=out.batch["position_ids"]).logits[:, P - 1:-1].float()
    flat = logits.reshape(-1, logits.shape[-1])
    for warper in (TemperatureLogitsWarper(0.9), TopKLogitsWarper(20), TopPLogitsWarper(0.8)):
        flat = warper(None, flat)
    ref = torch.log_softmax(flat, -1).gather(-1, out.batch["responses"].reshape(-1, 1)).view(8, 8)
    mask = out.batch["response_mask"].bool()
    assert torch.isfinite(ref[mask]).all()  # every sampled token survived the filters
    torch.testing.assert_close(out.batch["rollout_log_probs"][mask], ref[mask], atol=1e-4, rtol=0)


def test_checking_done_every_few_steps_changes_nothing():
    model = make_model("qwen")
    prompts = make_prompts(6, 10, model.config.vocab_size, seed=4, meta={"n": 2, "seeds": list(range(6))})
    kw = dict(max_num_seqs=4, stop_token_ids=[7, 8, 9, 10, 11])
    every = make_engine(model, 10, 12, **kw).generate(prompts)
    lazy = make_engine(model, 10, 12, **kw)
    lazy.check_every = 5  # the GPU default checks every 8 steps; finished rows decode masked meanwhile
    got = lazy.generate(prompts)
    assert torch.equal(got.batch["responses"], every.batch["responses"])
    assert torch.equal(got.batch["response_mask"], every.batch["response_mask"])
    torch.testing.assert_close(got.batch["rollout_log_probs"], every.batch["rollout_log_probs"], atol=1e-4, rtol=0)


def test_attended_kv_length_grows_with_the_context():
    """P=101, R=40: decode attends to 128 cache columns, then to all 144 — still exactly HF's greedy output."""
    model = make_model("qwen")
    P, R = 101, 40  # with check_every=4 one chunk ends exactly at column 128: off-by-one would show
    prompts = make_prompts(3, P, model.config.vocab_size, seed=9, meta={"do_sample": False})
    engine = make_engine(model, P, R, ignore_eos=True)
    engine.check_every = 4
    out = engine.generate(prompts)
    assert engine._runner.kv_buckets == [128, 144]
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    with torch.no_grad():  # naive greedy reference: a full HF forward per token, EOS not special
        for _ in range(R):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            nxt = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].argmax(-1, keepdim=True)
            ids, mask = torch.cat([ids, nxt], 1), torch.cat([mask, torch.ones_like(nxt)], 1)
    assert torch.equal(out.batch["responses"], ids[:, P:])


def test_state_dict_makes_default_seeds_resumable():
    model = make_model("tiny")
    prompts = make_prompts(3, 8, model.config.vocab_size)
    a = make_engine(model, 8, 6)
    a.generate(prompts)
    state = a.state_dict()
    first = a.generate(prompts).batch["responses"]
    assert not torch.equal(first, a.generate(prompts).batch["responses"])  # each call samples afresh
    b = make_engine(model, 8, 6)
    b.load_state_dict(state)
    assert torch.equal(b.generate(prompts).batch["responses"], first)


def test_free_cache_engine_releases_and_rebuilds():
    model = make_model("tiny")
    prompts = make_prompts(3, 8, model.config.vocab_size, meta={"seeds": [1, 2, 3]})
    engine = make_engine(model, 8, 6, free_cache_engine=True)
    first = engine.generate(prompts)
    assert engine._runner is None and engine._weights is None  # nothing held between generate calls
    assert first.meta_info["metrics"]["timing/rollout_cache_alloc"] > 0
    assert torch.equal(engine.generate(prompts).batch["responses"], first.batch["responses"])


def test_staggered_admission_near_the_cache_end():
    """P + R = T exactly and requests admitted at different steps: the attended length is capped at T."""
    model = make_model("qwen")
    prompts = make_prompts(8, 16, model.config.vocab_size, seed=6, meta={"seeds": list(range(8))})
    kw = dict(max_num_seqs=3, stop_token_ids=[7, 8, 9, 10, 11, 12, 13, 14, 15])
    lazy = make_engine(model, 16, 16, **kw)
    lazy.check_every = 8
    got = lazy.generate(prompts)
    ref = make_engine(model, 16, 16, **kw).generate(prompts)
    assert torch.equal(got.batch["responses"], ref.batch["responses"])
