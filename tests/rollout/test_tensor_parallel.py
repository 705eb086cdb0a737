"""Tensor-parallel generation on CPU (gloo): 2 and 4 ranks give one device's greedy and sampled tokens (top-k and
top-p too) and its log-probs, through prefill, decode (SDPA and range-attention paths) and the multi-turn extension
(both paths). Qwen2 (q/k/v biases, tied embeddings, vocab 301: padded shards) and Llama with one KV head (fewer KV
heads than ranks: replicated). One spawn of 4 ranks (processes are costly here): TP=2 in two groups, then TP=4."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from ranks_testlib import start_ranks
from rollout_helpers import EOS, PAD, make_engine, make_model, make_prompts, rollout_cfg
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from hybridflow.rollout import RolloutEngine, forward
from hybridflow.rollout.decode_attention import decode_attention_ref
from hybridflow.rollout.kv_store_kernel import store_kv_ref
from hybridflow.rollout.sampling import SamplingParams
from hybridflow.rollout.tensor_parallel import TPContext

P, R = 8, 12
CASES = {"greedy": {"do_sample": False}, "sample": {"n": 2}, "top_k": {"top_k": 4, "temperature": 0.7},
         "top_p": {"top_p": 0.8}, "top_k_p": {"top_k": 12, "top_p": 0.9, "temperature": 1.3}}


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "qwen2":  # q/k/v biases, tied embeddings, 8 query / 2 KV heads
        cfg = Qwen2Config(vocab_size=301, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)
    else:  # one KV head: replicated on every rank; q/k/v/o biases
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
                          attention_bias=True)  # o_proj bias: added once, after the all-reduce
    cfg.initializer_range = 0.2  # peaky logits, as rollout_helpers.make_model
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # HF initialises biases to zero, where adding one on every rank would go unseen
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
    return model


def _engines(model: torch.nn.Module, ctx: TPContext) -> tuple[RolloutEngine, RolloutEngine]:
    """One device's engine and this rank's tensor-parallel one, over the same module."""
    cfg = rollout_cfg(free_cache_engine=False, tensor_model_parallel_size=ctx.size)
    tp = RolloutEngine(model, cfg, eos_token_id=EOS, pad_token_id=PAD, max_prompt_length=P, max_response_length=R,
                       tp=ctx)
    return make_engine(model, P, R), tp


def _check_generate(one, tp, vocab: int) -> None:
    for name, meta in CASES.items():
        prompts = make_prompts(4, P, vocab, seed=len(name), meta={**meta, "seeds": [11, 12, 13, 14]})
        a, b = one.generate(prompts), tp.generate(prompts)
        assert torch.equal(a.batch["responses"], b.batch["responses"]), name
        assert a.batch["response_mask"].sum() > 4 * R // 2, name  # tokens were really drawn (not all stops)
        torch.testing.assert_close(b.batch["rollout_log_probs"], a.batch["rollout_log_probs"], atol=2e-5, rtol=0,
                                   msg=name)


def _extend_run(engine, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Admit 3 prompts, decode 2 steps, append tool tokens to each slot (different counts), decode 3 more."""
    runner = engine._prepare()
    runner.set_sampling(SamplingParams(top_k=30, ignore_eos=True), [EOS])
    pr = make_prompts(3, P, vocab, seed=7)
    ids, mask, pos = pr.batch["input_ids"], pr.batch["attention_mask"], pr.batch["position_ids"]
    runner.admit([0, 1, 2], ids, mask, pos, 1, [5, 6, 7], R)
    L = runner.cache.max_len
    for _ in range(2):
        runner.step_(3, L)
    items = [(s, [3 + s, 9, 4][: s + 1], int(pos[s, -1]) + 1) for s in range(3)]
    runner.extend_many(items, P)
    for _ in range(3):
        runner.step_(3, L)
    tok, logp, n = runner.harvest([0, 1, 2])
    return tok[:, : int(n.min())], logp[:, : int(n.min())]


def _check(kind: str, group: dist.ProcessGroup | None, ranged: bool) -> None:
    """Every sampling case and the extension, one device vs this rank's group; `ranged`: the GPU decode/extension
    layout (range attention, the K/V store, RoPE inside them) through the kernels' torch references."""
    model = _model(kind)
    ctx = TPContext.for_module(model, group)
    assert ctx.local.num_kv_heads == max(1, model.config.num_key_value_heads // ctx.size)
    # a plan from each rank's own free memory is agreed on: the group's smallest
    first = 0 if group is None else 2 * (dist.get_rank() // 2)  # the group's lowest rank
    assert ctx.agree_min(10 + dist.get_rank(), torch.device("cpu")) == 10 + first
    saved = forward._triton_attention, forward._triton_kv_store
    if ranged:
        forward._triton_attention = lambda device: decode_attention_ref
        forward._triton_kv_store = lambda device: store_kv_ref
    try:
        one, tp = _engines(model, ctx)
        assert (tp._prepare().ops.attention is decode_attention_ref) == ranged
        _check_generate(one, tp, model.config.vocab_size)
        a, b = _extend_run(one, model.config.vocab_size), _extend_run(tp, model.config.vocab_size)
    finally:
        forward._triton_attention, forward._triton_kv_store = saved
    assert torch.equal(a[0], b[0]) and a[0].shape[1] >= 6, (kind, ranged, a[0], b[0])
    torch.testing.assert_close(b[1], a[1], atol=2e-5, rtol=0)


def _worker(rank: int, world: int, store_dir: str) -> None:
    """Four ranks: groups {0, 1} and {2, 3} check TP=2 (one model each), then all four check TP=4 (the
    range-attention layout with Llama)."""
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    try:
        with torch.no_grad():
            kind = "qwen2" if rank < 2 else "llama"
            _check(kind, pairs[rank // 2], ranged=False)
            _check("qwen2", None, ranged=False)
            _check("llama", None, ranged=True)
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_generation_equals_one_device(tmp_path):
    start_ranks(_worker, (4, str(tmp_path)), 4)


def test_group_size_must_match_the_config_key():
    with pytest.raises(ValueError, match="rollout.tensor_model_parallel_size=2"):
        make_engine(make_model("tiny"), P, R, tensor_model_parallel_size=2)
