"""TrainEngine on one gloo rank: gradients against a naive reference, split invariance, offload, overfitting,
checkpoint round trip, skipped steps, critic and reward heads."""

import math

import pytest
import torch
from engine_testlib import (
    load_engine,
    logprobs,
    make_batch,
    make_config,
    make_engine,
    nan_loss,
    nll_loss,
    save_engine,
    train_step,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hybridflow.algorithms.aggregation import agg_loss
from hybridflow.engine import TrainEngine, invariant
from hybridflow.models import load_model
from hybridflow.workers.engine_specs import SCORES, VALUES, ref_spec, reward_model_spec

pytestmark = pytest.mark.usefixtures("dist_group")


_engine = make_engine


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _grads(engine):
    return {n: _full(p.grad) for n, p in engine.module.named_parameters()}


def _weights(engine):
    return {n: _full(p) for n, p in engine.module.named_parameters()}


def _reference(data):
    """Loss and gradients of the token-mean NLL over the whole batch, plain HF model, padded, full softmax."""
    model = load_model(make_config().model, "actor")
    b = data.batch
    R = b["responses"].shape[1]
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                   position_ids=b["position_ids"]).logits[:, -R - 1:-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, b["responses"][..., None]).squeeze(-1)
    mask = b["response_mask"].float()
    loss = -(logp * mask).sum() / mask.sum()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("overrides", [
    ("actor.ppo_micro_batch_size_per_gpu=8",),
    ("actor.ppo_micro_batch_size_per_gpu=2",),
    ("actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=25"),
    ("data.use_packed_dataset=false", "actor.ppo_micro_batch_size_per_gpu=2"),
    ("model.enable_gradient_checkpointing=true", "actor.ppo_micro_batch_size_per_gpu=4"),
    pytest.param(("model.use_torch_compile=true", "actor.ppo_micro_batch_size_per_gpu=4"), marks=pytest.mark.xfail(
        torch.backends.cpu.get_cpu_capability() != "AVX512", raises=RuntimeError, strict=False,
        reason="known issue: Inductor's CPU code for the compiled decoder layer failed its own index check ('index out "
               "of bounds: 0 <= tmp16 < 10') with ATEN_CPU_CAPABILITY=avx2 (torch 2.13) at d60c160; since the engine "
               "refactor it passed (fresh clone of 05e6f54 under the AVX2 emulation), so not strict: either outcome "
               "under AVX2 is accepted, a wrong gradient is not (the asserts below); CPU compile is off by default")),
])
def test_gradients_match_reference_for_any_micro_batching(overrides):
    data = make_batch(seed=0)
    ref_loss, ref_grads = _reference(data)
    engine = _engine(*overrides)
    assert engine.module.base_model.layers[0].gradient_checkpointing == ("model.enable_gradient_checkpointing=true" in overrides)
    metrics = train_step(engine, data, nll_loss)
    assert metrics["loss"] == pytest.approx(ref_loss, rel=1e-5)
    grads = _grads(engine)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-4, msg=name)
    assert metrics["grad_norm"] == pytest.approx(
        math.sqrt(sum(float(g.pow(2).sum()) for g in ref_grads.values())), rel=1e-4)
    assert metrics["skipped"] == 0 and metrics["num_tokens"] == data.batch["attention_mask"].sum()


def test_deferred_grad_sync_on_one_rank_is_bitwise_the_per_micro_batch_sum(monkeypatch):
    """bf16 compute over fp32 master weights, 4 micro-batches: FSDP2's unsharded fp32 accumulation (one reduce per
    mini-batch) gives exactly the gradients of reducing every micro-batch."""
    data = make_batch(seed=0)
    overrides = ("model.dtype=bfloat16", "actor.ppo_micro_batch_size_per_gpu=2")
    deferred = _engine(*overrides)
    train_step(deferred, data, nll_loss)
    monkeypatch.setattr(TrainEngine, "_set_grad_sync", lambda self, sync: None)
    synced = _engine(*overrides)
    train_step(synced, data, nll_loss)
    gd, gs = _grads(deferred), _grads(synced)
    assert all(g.dtype == torch.float32 for g in gd.values())
    for name in gs:
        assert torch.equal(gd[name], gs[name]), name
    wd, ws = _weights(deferred), _weights(synced)
    assert all(torch.equal(wd[n], ws[n]) for n in ws)


def test_deferral_only_when_reduce_dtype_is_as_wide_as_master():
    assert _engine("model.dtype=bfloat16")._defer_grad_sync  # fp32 reduce over fp32 master
    assert not _engine("model.dtype=bfloat16", "actor.fsdp.reduce_dtype=bfloat16")._defer_grad_sync


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward blew up")


@pytest.mark.parametrize("where", ["loss", "backward"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("torch_reset", [True, False], ids=["reset_iter_state", "older-torch"])
def test_failure_mid_mini_batch_leaves_no_partial_state(where, dtype, torch_reset, monkeypatch):
    """The 3rd of 4 micro-batches fails (in the loss, or inside the first decoder layer's backward): the error
    reaches the caller, and the next two steps equal a fresh engine's: no gradient left accumulated (fp32: on the
    unsharded parameters; bf16 compute: in FSDP2's fp32 buffers), FSDP2's per-iteration state reset (else the
    root's post-backward never runs again). `older-torch`: without FSDPModule.reset_iter_state (torch < 2.12)."""
    data = make_batch(seed=0)
    overrides = (f"model.dtype={dtype}", "actor.ppo_micro_batch_size_per_gpu=2")
    calls = []

    def counting(outputs, mb, norm):
        calls.append(1)
        if where == "loss" and len(calls) == 3:
            raise RuntimeError("loss blew up")
        return nll_loss(outputs, mb, norm)

    failed = _engine(*overrides)
    if not torch_reset:
        monkeypatch.delattr(FSDPModule, "reset_iter_state", raising=False)

    def boom_in_backward(module, args, output):  # the forward of micro-batch 3
        if len(calls) == 2 and torch.is_grad_enabled():
            return (_Boom.apply(output[0]), *output[1:]) if isinstance(output, tuple) else _Boom.apply(output)

    hook = failed.module.base_model.layers[0].register_forward_hook(boom_in_backward) if where == "backward" else None
    with pytest.raises(RuntimeError, match="blew up"):
        train_step(failed, data, counting)
    if hook is not None:
        hook.remove()
    assert failed.global_step == 0
    fresh = _engine(*overrides)
    for _ in range(2):
        assert train_step(failed, data, nll_loss)["loss"] == train_step(fresh, data, nll_loss)["loss"]
        gf, gr = _grads(failed), _grads(fresh)
        assert all(torch.equal(gf[n], gr[n]) for n in gr)
        wf, wr = _weights(failed), _weights(fresh)
        assert all(torch.equal(wf[n], wr[n]) for n in wr)


def test_a_failing_reset_keeps_the_original_error_and_says_so(monkeypatch, caplog):
    engine = _engine("actor.ppo_micro_batch_size_per_gpu=2")

    def broken_reset(self):
        raise AttributeError("private FSDP field moved")

    def failing(outputs, mb, norm):
        raise ValueError("loss blew up")

    monkeypatch.setattr(TrainEngine, "_drop_partial_grads", broken_reset)
    with pytest.raises(ValueError, match="loss blew up"):
        train_step(engine, make_batch(seed=0), failing)
    assert "resetting the engine's gradients/FSDP state failed (AttributeError" in caplog.text


def test_defer_grad_sync_false_turns_it_off_on_one_rank():
    assert not _engine("actor.fsdp.defer_grad_sync=false")._defer_grad_sync
    assert _engine()._defer_grad_sync


def test_offload_on_off_same_result():
    data = make_batch(seed=1)
    runs = []
    for offload in ("false", "true"):
        engine = _engine(f"actor.fsdp.param_offload={offload}", f"actor.fsdp.optimizer_offload={offload}")
        for _ in range(2):
            train_step(engine, data, nll_loss)
        engine.to_mode("generate")
        engine.to_mode("offload")
        engine.to_mode("train")
        runs.append(logprobs(engine, data)["log_probs"])
    torch.testing.assert_close(runs[0], runs[1], atol=1e-6, rtol=0)


def test_tiny_model_overfits_one_batch():
    data = make_batch(seed=2)
    engine = _engine("actor.optim.lr=1e-2")
    first = train_step(engine, data, nll_loss)["loss"]
    for _ in range(40):
        last = train_step(engine, data, nll_loss)["loss"]
    assert last < 0.1 * first, (first, last)


def test_save_load_gives_identical_next_step(tmp_path):
    data, data2 = make_batch(seed=3), make_batch(seed=4)
    a = _engine("actor.optim.lr_warmup_steps=3")
    train_step(a, data, nll_loss)
    save_engine(a, tmp_path / "ckpt")
    m_a = train_step(a, data2, nll_loss)
    b = _engine("actor.optim.lr_warmup_steps=3")
    load_engine(b, tmp_path / "ckpt")
    assert b.global_step == 1
    m_b = train_step(b, data2, nll_loss)
    assert m_a["loss"] == m_b["loss"] and m_a["lr"] == m_b["lr"]
    wa, wb = _weights(a), _weights(b)
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def test_non_finite_loss_skips_the_optimizer_step():
    engine = _engine()
    data = make_batch(seed=5)
    before = _weights(engine)

    metrics = train_step(engine, data, nan_loss)
    assert metrics["skipped"] == 1
    after = _weights(engine)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert train_step(engine, data, nll_loss)["skipped"] == 0


def test_ppo_epochs_and_mini_batches_count_optimizer_steps():
    engine = _engine("actor.ppo_mini_batch_size=2", "actor.ppo_epochs=2", "actor.optim.lr=1e-3")
    data = make_batch(seed=6)
    calls = []

    def counting_loss(outputs, mb, norm):
        calls.append(len(mb))
        return nll_loss(outputs, mb, norm)

    # 2 prompts × 2 responses = 4 samples per mini-batch → 2 mini-batches × 2 epochs
    train_step(engine, data, counting_loss, mini_batch_size=4, epochs=2)
    assert calls == [4, 4, 4, 4]
    assert engine.optimizer.state[next(iter(engine.module.parameters()))]["step"] == 4


def test_lr_warmup_and_cosine():
    engine = _engine("actor.optim.lr_warmup_steps=2", "actor.optim.lr_scheduler=cosine",
                     "actor.optim.min_lr_ratio=0.1", total_training_steps=6)
    data = make_batch(seed=7)
    lrs = [engine.optimizer.param_groups[0]["lr"]]
    for _ in range(6):
        train_step(engine, data, nll_loss)
        lrs.append(engine.optimizer.param_groups[0]["lr"])
    # Warmup reaches the peak at its last step; cosine then decays from the peak to min_lr at the last step.
    expected = [0.5e-3, 1e-3] + [1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]
    assert lrs == pytest.approx(expected, rel=1e-6)


def test_critic_learns_values():
    engine = _engine("critic.optim.lr=1e-2", "critic.ppo_mini_batch_size=8", "critic.ppo_micro_batch_size_per_gpu=4",
                     "critic.grad_clip=1e6", role="critic")
    data = make_batch(seed=8)
    target = torch.linspace(-1, 1, data.batch["responses"].shape[1]).expand_as(data.batch["responses"])
    data.batch["returns"] = target.clone()

    def value_loss(outputs, mb, norm):
        loss = agg_loss((outputs["values"] - mb.batch["returns"]) ** 2, mb.batch["response_mask"], "token-mean",
                        norm["token-mean"])
        return loss, {}

    first = train_step(engine, data, value_loss)["loss"]
    for _ in range(30):
        last = train_step(engine, data, value_loss)["loss"]
    assert last < 0.1 * first, (first, last)
    values = engine.infer(data, VALUES)["values"]
    mask = data.batch["response_mask"].bool()
    assert values.shape == target.shape and (values[~mask] == 0).all()
    assert ((values - target)[mask] ** 2).mean() < 0.1 * first


def test_forward_logprobs_micro_batching_invariant():
    data = make_batch(seed=9)
    a = logprobs(_engine("actor.log_prob_micro_batch_size_per_gpu=8"), data, 0.5, entropy=True)
    b = logprobs(_engine("actor.use_dynamic_bsz=true", "actor.log_prob_max_token_len_per_gpu=20"), data, 0.5,
                 entropy=True)
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-5)
    assert a["log_probs"].shape == data.batch["responses"].shape


def test_the_exporter_writes_the_trained_weights(tmp_path):
    from hybridflow.engine.checkpoint import full_model_state, write_hf

    engine = _engine()
    train_step(engine, make_batch(seed=10), nll_loss)
    write_hf(full_model_state(engine.module), make_config().model, tmp_path / "hf")
    cfg = make_config(f"model.path={tmp_path / 'hf'}")
    loaded = load_model(cfg.model, "actor")
    trained = _weights(engine)
    for name, p in loaded.named_parameters():
        assert torch.equal(p, trained[name]), name


def test_reference_and_reward_roles_are_inference_only():
    cfg = make_config()
    ref = TrainEngine(ref_spec(cfg), device="cpu")
    actor = _engine()
    data = make_batch(seed=12)
    torch.testing.assert_close(logprobs(ref, data)["log_probs"], logprobs(actor, data)["log_probs"], atol=0, rtol=0)
    with pytest.raises(ValueError, match="not trainable"):
        train_step(ref, data, nll_loss)
    rm = TrainEngine(reward_model_spec(cfg), device="cpu")
    scores = rm.infer(data, SCORES)["scores"]
    naive = load_model(cfg.model, "reward")
    b = data.batch
    for i in range(len(data)):
        keep = b["attention_mask"][i].bool()
        with torch.no_grad():
            last = naive(input_ids=b["input_ids"][i][keep][None]).logits[0, -1, 0]
        torch.testing.assert_close(scores[i], last, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="scalar head"):
        actor.infer(data, VALUES)


def test_exact_logprobs_update_has_the_default_gradients():
    """`actor_rollout.exact_logprobs` changes only forward values (last bits); backward is the plain ops', so one
    update's gradients are the default engine's (engine/invariant.py)."""
    data = make_batch(seed=1)
    exact, plain = _engine("actor_rollout.exact_logprobs=true"), _engine()
    assert invariant.installed(exact.module) and not invariant.installed(plain.module)
    train_step(exact, data, nll_loss)
    train_step(plain, data, nll_loss)
    ge, gp = _grads(exact), _grads(plain)
    for name, g in gp.items():
        torch.testing.assert_close(ge[name], g, atol=1e-6, rtol=1e-4, msg=name)
