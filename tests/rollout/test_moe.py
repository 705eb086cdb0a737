"""MoE in the rollout engine (rollout/moe.py), routing replay (engine/moe_replay.py) and the load-balancing loss
(engine/moe_aux.py) in the trainer, against naive references: HF generate, HF's own routers, an HF forward whose
routers are forced to given experts, and HF's own load-balancing loss. (Logit parity per family:
test_model_families.py.)"""

from __future__ import annotations

import pytest
import torch
from ppo_testlib import tiny_ppo_config
from rollout_helpers import EOS, PAD, make_engine, make_prompts
from test_model_families import VOCAB, hf_response_logprobs, make_family, train_engine_for
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as hf_load_balancing_loss

from hybridflow.config import load_config
from hybridflow.engine import HeadRequest, TrainEngine, UpdatePlan, moe_replay, train_update
from hybridflow.engine.moe_aux import load_balancing_loss
from hybridflow.rollout import RolloutEngine, moe
from hybridflow.trainer.ppo import PPOTrainer
from hybridflow.workers.engine_specs import actor_spec

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
    _perturb_routers(model)
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


def _perturb_routers(model) -> None:
    """Move the routers a little, so that the trainer's own top-k differs from the recorded one on some tokens."""
    with torch.no_grad():
        for gate in moe_replay.routers(model):
            gate.weight.add_(torch.randn(gate.weight.shape, generator=torch.Generator().manual_seed(1)) * 0.05)


@pytest.mark.parametrize("aux_coef", [0.0, 0.5])
def test_replay_with_gradient_checkpointing_gives_the_gradients_without_it(aux_coef, gloo, tmp_path):
    """Checkpointed layers run their forward again in backward; with replay on, that recomputation must route to the
    recorded experts as the forward did (its own routing saves other tensors: torch's CheckpointError). Two
    micro-batches of perturbed routers: the same gradients as without checkpointing, the load-balancing loss on or
    off."""
    model = make_family("qwen3_moe")
    out = make_engine(model, P, R).generate(make_prompts(3, P, VOCAB, seed=4, meta={"n": 2}))
    _perturb_routers(model)
    grads = {}
    for ckpt in ("false", "true"):
        engine = train_engine_for(model, tmp_path / ckpt, "actor.moe.routing_replay=true",
                                  f"model.enable_gradient_checkpointing={ckpt}", f"actor.moe.aux_loss_coef={aux_coef}",
                                  "actor.ppo_micro_batch_size_per_gpu=3")
        calls = []
        hook = moe_replay.routers(engine.module)[0].register_forward_hook(lambda *a, seen=calls: seen.append(1))
        with engine.training():
            metrics = engine.forward_backward(out, _push_up, HeadRequest("lm", temperature=1.0)).metrics
            grads[ckpt] = _grads(engine)
        hook.remove()
        assert len(calls) == (4 if ckpt == "true" else 2)  # checkpointing: each micro-batch's layer runs twice
        assert ("moe/aux_loss" in metrics) == (aux_coef > 0)
    agreement = moe_replay.metrics(engine.infer(out, HeadRequest("lm", temperature=1.0)), out.batch)
    assert agreement["moe/routing_agreement"] < 1.0  # replay changes some tokens' experts
    assert grads["true"].keys() == grads["false"].keys()
    assert all(grads["false"][n].abs().max() > 0 for n in grads["false"] if "mlp.gate." in n)
    for n in grads["false"]:
        torch.testing.assert_close(grads["true"][n], grads["false"][n], atol=1e-7, rtol=1e-6)


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


# ------------------------------------------------------------------------ load-balancing loss (engine/moe_aux.py)
def test_load_balancing_loss_equals_hf_and_padding_does_not_count():
    """Ours against transformers' function on the same router logits: padded rows with their mask, and the same
    real rows packed (no mask). Padding positions route to expert 0 only, so counting them would show."""
    g = torch.Generator().manual_seed(0)
    B, L, E, k = 3, 7, 8, 2
    mask_BL = torch.ones(B, L, dtype=torch.long)
    mask_BL[0, :3] = 0  # left-padded prompt
    mask_BL[1, 5:] = 0  # right-padded response
    real = mask_BL.flatten().bool()
    logits = [torch.randn(B * L, E, generator=g) for _ in range(3)]
    for t in logits:
        t[~real, 0] += 20.0
    want = hf_load_balancing_loss(tuple(logits), E, k, mask_BL)
    torch.testing.assert_close(load_balancing_loss(logits, k, mask_BL), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(load_balancing_loss([t[real] for t in logits], k, None), want, atol=1e-6, rtol=0)
    assert abs(float(hf_load_balancing_loss(tuple(logits), E, k, None) - want)) > 0.1  # padding would count


def _grads(engine: TrainEngine) -> dict[str, torch.Tensor]:
    return {n: _full(p.grad) for n, p in engine.module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family,variant", [("qwen3_moe", "packed"), ("qwen3_moe", "padded"),
                                            ("qwen3_moe", "checkpointing"), ("qwen3_moe", "replay"),
                                            ("mixtral", "packed"), ("qwen2_moe", "packed")])
def test_aux_loss_and_its_router_gradients_equal_hf(family, variant, gloo, tmp_path):
    """Two micro-batches of 3 rows: `moe/aux_loss` is the mean of HF's `aux_loss` per micro-batch, and adding the
    term changes the router gradients by exactly coef x the gradient of HF's losses weighted by each micro-batch's
    share of the real tokens; lm_head, which the term does not reach, gets the same gradient."""
    coef = 0.5
    model = make_family(family)
    out = make_engine(model, P, R).generate(make_prompts(3, P, VOCAB, seed=4, meta={"n": 2}))
    b = out.batch
    if variant == "replay":  # the routers' own experts (also for each row's last token, which the rollout
        b["routed_experts"] = hf_routes(model, b)  # does not record): the same forward as without replay
    tokens = b["attention_mask"].sum()
    hf_aux, weighted = [], 0.0
    for rows in (slice(0, 3), slice(3, 6)):
        res = model(input_ids=b["input_ids"][rows], attention_mask=b["attention_mask"][rows],
                    position_ids=b["position_ids"][rows], output_router_logits=True)
        hf_aux.append(float(res.aux_loss.detach()))
        weighted = weighted + res.aux_loss * b["attention_mask"][rows].sum() / tokens
    gates = [n for n, _ in model.named_parameters() if "mlp.gate." in n]
    want = dict(zip(gates, torch.autograd.grad(weighted, [dict(model.named_parameters())[n] for n in gates])))
    extra = {"packed": [], "padded": ["data.use_packed_dataset=false"],
             "checkpointing": ["model.enable_gradient_checkpointing=true"],
             "replay": ["actor.moe.routing_replay=true"]}[variant]
    grads, stats = {}, {}
    for c in (0.0, coef):
        engine = train_engine_for(model, tmp_path / str(c), f"actor.moe.aux_loss_coef={c}",
                                  "actor.ppo_micro_batch_size_per_gpu=3", *extra)
        calls = []  # the first router's forwards: checkpointing runs each again in backward
        hook = moe_replay.routers(engine.module)[0].register_forward_hook(lambda *a, seen=calls: seen.append(1))
        with engine.training():
            stats[c] = engine.forward_backward(out, _push_up, HeadRequest("lm", temperature=1.0)).metrics
            grads[c] = _grads(engine)
        hook.remove()
        assert len(calls) == (4 if variant == "checkpointing" else 2)
    assert "moe/aux_loss" not in stats[0.0]
    assert float(stats[coef]["moe/aux_loss"]) == pytest.approx(sum(hf_aux) / 2, abs=1e-6)
    assert len(want) == len(moe_replay.routers(model)) and all(want[n].abs().max() > 1e-4 for n in want)
    for n in want:
        torch.testing.assert_close(grads[coef][n] - grads[0.0][n], coef * want[n], atol=1e-6, rtol=1e-4)
    assert torch.equal(grads[coef]["lm_head.weight"], grads[0.0]["lm_head.weight"])


def test_aux_loss_coef_is_refused_when_negative_or_for_a_dense_model(gloo):
    with pytest.raises(ValueError, match=r"actor\.moe\.aux_loss_coef=-0\.1: must be >= 0"):
        load_config([], ["actor.moe.aux_loss_coef=-0.1"])
    with pytest.raises(ValueError, match=r"actor\.moe\.aux_loss_coef=0\.01: .* model_type='qwen2'"):
        TrainEngine(actor_spec(load_config([], ["model.preset=tiny", "actor.moe.aux_loss_coef=0.01"])), device="cpu")


def test_ppo_step_on_tiny_moe_adds_the_aux_loss_and_logs_it(tmp_path):
    """One GRPO step through the trainer, the actor worker and `train_update` (one micro-batch): the update's loss
    is the policy loss plus coef x `moe/aux_loss`, which lies between 0 and the number of experts."""
    coef = 0.01
    cfg = tiny_ppo_config(tmp_path, tmp_path / "ckpt", 2, "model.preset=tiny-moe", "trainer.total_training_steps=1",
                          "trainer.checkpoint.save_freq=0", "actor.ppo_micro_batch_size_per_gpu=8",
                          f"actor.moe.aux_loss_coef={coef}")
    trainer = PPOTrainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()
    m = trainer.history[-1]
    assert 0 < m["moe/aux_loss"] <= 8, m
    assert m["actor/loss"] == pytest.approx(m["actor/pg_loss"] + coef * m["moe/aux_loss"], rel=1e-5, abs=1e-7)
