"""MoE in the rollout engine (rollout/moe.py) and routing replay in the trainer (engine/moe_replay.py), against
naive references: HF generate, HF's own routers, and an HF forward whose routers are forced to given experts.
(Logit parity per family: test_model_families.py.)"""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import EOS, PAD, make_engine, make_prompts
from test_model_families import VOCAB, hf_response_logprobs, make_family, train_engine_for

from hybridflow.engine import HeadRequest, UpdatePlan, moe_replay, train_update
from hybridflow.rollout import RolloutEngine, moe

P, R = 10, 6
MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")


def hf_routes(model, batch) -> torch.Tensor:
    """[B, L, moe layers, k]: the top-k of each HF router over the rows (hooks on the routers' outputs)."""
    seen = []
    hooks = [g.register_forward_hook(lambda m, a, out: seen.append(out[2])) for g in moe_replay.routers(model)]
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
    for h in hooks:
        h.remove()
    B, L = batch["input_ids"].shape
    return torch.stack([s.view(B, L, -1) for s in seen], dim=2)


def test_grouped_experts_equal_dense_and_a_per_token_loop():
    g = torch.Generator().manual_seed(0)
    N, H, E, k, inter = 7, 16, 6, 2, 8
    x, gate_up, down = torch.randn(N, H, generator=g), torch.randn(E, 2 * inter, H, generator=g), \
        torch.randn(E, H, inter, generator=g)
    idx, scores = moe.route(torch.randn(N, E, generator=g), k, norm_topk=True, fp32_scores=True)
    ref = torch.zeros(N, H)
    for n in range(N):
        for j in range(k):
            gt, up = (gate_up[idx[n, j]] @ x[n]).chunk(2)
            ref[n] += scores[n, j] * (down[idx[n, j]] @ (torch.nn.functional.silu(gt) * up))
    torch.testing.assert_close(moe.experts_grouped(x, idx, scores, gate_up, down), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(moe.experts_dense(x, idx, scores, gate_up, down), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(scores.sum(-1), torch.ones(N))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_greedy_matches_hf_generate_and_records_hf_routing(family):
    model = make_family(family)
    prompts = make_prompts(4, P, VOCAB, seed=7, meta={"do_sample": False})
    engine = make_engine(model, P, R)
    assert engine._fallback is None, f"{family} fell back to HF generate"
    out = engine.generate(prompts)
    with torch.no_grad():
        ref = model.generate(input_ids=prompts.batch["input_ids"], attention_mask=prompts.batch["attention_mask"],
                             max_new_tokens=R, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)[:, P:]
    got = out.batch["responses"]
    assert torch.equal(got[:, :ref.shape[1]], ref), (got, ref)
    routes = out.batch["routed_experts"]
    n_moe = len(moe_replay.routers(model))
    assert routes.shape == (4, P + R, n_moe, 2) and routes.dtype == torch.int16
    real = out.batch["attention_mask"].bool()
    real[torch.arange(4), P + out.batch["response_mask"].sum(-1) - 1] = False  # the last token is never fed back
    want = hf_routes(model, out.batch)
    assert torch.equal(routes.long().sort(-1).values[real], want.sort(-1).values[real])
    again = engine._routing(out)  # the re-prefill that multi-turn rows use (their extensions are not recorded)
    assert torch.equal(again.long().sort(-1).values[real], want.sort(-1).values[real])


def test_moe_with_tensor_parallel_is_refused():
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2"):
        RolloutEngine(make_family("qwen3_moe"), type("Cfg", (), {"tensor_model_parallel_size": 2})(),
                      eos_token_id=EOS, pad_token_id=PAD, max_prompt_length=P, max_response_length=R)


def _forced_hf_logprobs(model, out, routes_BLMk: torch.Tensor) -> torch.Tensor:
    """HF's forward (padded rows) with every router returning the given experts, scores from its own logits."""
    originals = []
    for j, gate in enumerate(moe_replay.routers(model)):
        originals.append((gate, gate.forward))

        def forced(h, gate=gate, j=j):
            logits = torch.nn.functional.linear(h.reshape(-1, h.shape[-1]), gate.weight)
            want = routes_BLMk[:, :, j].reshape(-1, routes_BLMk.shape[-1]).long()
            s = torch.softmax(logits.float(), -1).gather(-1, want)
            return logits, (s / s.sum(-1, keepdim=True)).to(logits.dtype), want  # qwen3_moe: norm_topk_prob
        gate.forward = forced
    try:
        return hf_response_logprobs(model, out)
    finally:
        for gate, fwd in originals:
            gate.forward = fwd


@pytest.mark.parametrize("replay", [False, True])
def test_trainer_replays_the_rollout_routing(replay, gloo, tmp_path):
    """The rollout routes with the original routers; the trainer's routers are perturbed so that some tokens pick
    other experts. Replay on: the trainer's log-probs are exactly those of the recorded experts; off: HF's own."""
    model = make_family("qwen3_moe")
    out = make_engine(model, P, R).generate(make_prompts(3, P, VOCAB, seed=4, meta={"n": 2}))
    routes = out.batch["routed_experts"]
    with torch.no_grad():
        for gate in moe_replay.routers(model):
            gate.weight.add_(torch.randn(gate.weight.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    overrides = ["actor.moe.routing_replay=true"] if replay else []
    engine = train_engine_for(model, tmp_path, *overrides)
    res = engine.infer(out, HeadRequest("lm", temperature=1.0))
    mask = out.batch["response_mask"]
    ours = res["log_probs"] * mask
    metrics = moe_replay.metrics(res, out.batch)
    assert 0.1 < metrics["moe/routing_agreement"] < 1.0, metrics  # the perturbed routers disagree on some tokens
    forced, own = _forced_hf_logprobs(model, out, routes), hf_response_logprobs(model, out)
    assert (forced - own).abs().max() > 1e-3  # the two references really differ
    torch.testing.assert_close(ours, forced if replay else own, atol=1e-4, rtol=0)
    gap_ref = ((forced if replay else own) - out.batch["rollout_log_probs"]).abs()[mask.bool()].mean()
    assert metrics["moe/logprob_gap"] == pytest.approx(float(gap_ref), abs=1e-4)
    # one FSDP2 update through the (replayed) MoE layers: routers and experts get gradients and move
    before = {n: _full(p).clone() for n, p in engine.module.named_parameters() if "mlp.gate." in n or "experts" in n}
    train_update(engine, out, _push_up, HeadRequest("lm", temperature=1.0), UpdatePlan(6))
    after = dict(engine.module.named_parameters())
    assert len(before) == 6 and all(not torch.equal(before[n], _full(after[n])) for n in before)
    pushed = engine.infer(out, HeadRequest("lm", temperature=1.0))["log_probs"] * mask
    assert (pushed - ours).sum() > 0


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


def _push_up(outputs, micro, norm):
    return -(outputs["log_probs"] * micro.batch["response_mask"]).sum() / norm["token-mean"], {}


def test_lora_on_attention_and_shared_expert_is_merged(gloo, tmp_path):
    """`all-linear` LoRA on Qwen2-MoE adapts attention and the shared expert (and its gate); the experts and the
    router are not Linear modules in transformers, so they stay base weights. Generation merges the adapters."""
    engine = train_engine_for(make_family("qwen2_moe"), tmp_path, "model.lora.rank=4", "model.lora.alpha=8")
    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            if "lora_B" in name:
                (p.to_local() if hasattr(p, "to_local") else p).normal_(0.0, 0.1)
    adapted = {n.split(".mlp.")[1] for n, m in engine.module.named_modules() if hasattr(m, "lora_A") and ".mlp." in n}
    assert {"shared_expert.gate_proj", "shared_expert_gate"} <= adapted
    assert not any(a == "gate" or a.startswith("experts") for a in adapted), adapted
    rollout = make_engine(engine.module, P, R)
    assert rollout._fallback is None
    out = rollout.generate(make_prompts(3, P, VOCAB, seed=3, meta={"n": 2}))
    ref = engine.infer(out, HeadRequest("lm", temperature=1.0))["log_probs"] * out.batch["response_mask"]
    base = hf_response_logprobs(make_family("qwen2_moe"), out)
    assert (ref - base).abs().max() > 1e-2  # the adapters change the outputs
    torch.testing.assert_close(out.batch["rollout_log_probs"], ref, atol=1e-4, rtol=0)
