"""LoRA on the TrainEngine (tiny preset, CPU, fp32): config errors, only adapters (and a value head) train, the
adapters-off reference equals the base model bit for bit, checkpoints hold the trained parameters only."""

from __future__ import annotations

import pytest
import torch
from engine_testlib import (
    head_of,
    load_engine,
    logprobs,
    make_batch,
    make_config,
    make_engine,
    nll_loss,
    save_engine,
    train_step,
)

from hybridflow.config import ConfigError
from hybridflow.engine.lora import is_adapter_param

LORA = ("model.lora.rank=4", "model.lora.alpha=8", "actor.optim.lr=5e-2")


@pytest.mark.parametrize("override, fragment", [
    ("model.lora.rank=-1", "model.lora.rank"),
    ("model.lora.alpha=0", "model.lora.alpha"),
    ("model.lora.dropout=1.0", "model.lora.dropout"),
    ("model.lora.target_modules=all", "all-linear"),
    ("model.lora.target_modules=[]", "model.lora.target_modules"),
])
def test_bad_lora_config_names_the_key(override: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        make_config(override)


def test_lora_with_ema_reference_is_refused() -> None:
    with pytest.raises(ConfigError, match="ref.ema.enable=false"):
        make_config("model.lora.rank=4", "ref.ema.enable=true")


def test_unknown_target_module_names_the_choices(dist_group) -> None:
    with pytest.raises(ValueError, match=r"model.lora.target_modules.*q_proj"):
        make_engine("model.lora.rank=4", "model.lora.target_modules=[qkv]")


def test_rank_zero_is_full_fine_tuning(dist_group) -> None:
    engine = make_engine()
    assert engine.lora_targets is None
    assert all(p.requires_grad for p in engine.module.parameters())
    assert not any(is_adapter_param(n) for n, _ in engine.module.named_parameters())


def test_only_adapters_train_and_start_as_the_base_model(dist_group) -> None:
    engine, base = make_engine(*LORA), make_engine()
    assert engine.lora_targets == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    trained = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    assert trained and all(is_adapter_param(n) for n in trained)
    assert all(p.dtype == torch.float32 for n, p in engine.module.named_parameters() if is_adapter_param(n))
    opt_params = {id(p) for g in engine.optimizer.param_groups for p in g["params"]}
    assert opt_params == {id(p) for p in engine.module.parameters() if p.requires_grad}

    data = make_batch()
    assert torch.equal(logprobs(engine, data)["log_probs"], logprobs(base, data)["log_probs"])  # B = 0 at init
    frozen = {n: _local(p).clone() for n, p in engine.module.named_parameters() if not p.requires_grad}
    for _ in range(3):
        train_step(engine, data, nll_loss)
    after = dict(engine.module.named_parameters())
    assert all(torch.equal(frozen[n], _local(after[n])) for n in frozen)  # the base never moves
    assert not torch.equal(logprobs(engine, data)["log_probs"], logprobs(base, data)["log_probs"])


def test_targets_list_adapts_only_those(dist_group) -> None:
    engine = make_engine("model.lora.rank=2", "model.lora.target_modules=[q_proj, v_proj]")
    assert engine.lora_targets == ["q_proj", "v_proj"]
    adapted = {n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n, _ in engine.module.named_parameters() if ".lora_A." in n}
    assert adapted == {"q_proj", "v_proj"}


def test_reference_is_the_base_model_exactly(dist_group) -> None:
    """With LoRA the reference is the actor with adapters disabled: bit-equal to a separately built base model."""
    engine, base = make_engine(*LORA), make_engine()
    data = make_batch(seed=3)
    for _ in range(2):
        train_step(engine, data, nll_loss)
    head = head_of(engine, temperature=0.7)
    ref = engine.infer(data, head, disable_adapters=True)["log_probs"]
    assert torch.equal(ref, base.infer(data, head)["log_probs"])
    assert not torch.equal(ref, engine.infer(data, head)["log_probs"])  # adapters are back on afterwards
    assert all(p.requires_grad for n, p in engine.module.named_parameters() if is_adapter_param(n))
    with pytest.raises(ValueError, match="model.lora.rank"):
        base.infer(data, head, disable_adapters=True)


def test_critic_trains_adapters_and_the_whole_value_head(dist_group) -> None:
    critic = make_engine(*LORA, role="critic")
    trained = {n for n, p in critic.module.named_parameters() if p.requires_grad}
    assert "score.weight" in trained and all(is_adapter_param(n) or n.startswith("score.") for n in trained)
    assert critic.module.score.weight.dtype == torch.float32


def test_checkpoint_holds_trained_parameters_only_and_round_trips(dist_group, tmp_path) -> None:
    engine = make_engine(*LORA)
    data = make_batch(seed=5)
    for _ in range(2):
        train_step(engine, data, nll_loss)
    state = engine.state_dict()
    assert state["model"] and all(is_adapter_param(k) for k in state["model"])
    assert set(state["optimizer"]["state"]) == set(state["model"])  # Adam moments of the adapters only
    save_engine(engine, tmp_path / "ckpt")

    fresh = make_engine(*LORA)
    load_engine(fresh, tmp_path / "ckpt")
    assert torch.equal(logprobs(fresh, data)["log_probs"], logprobs(engine, data)["log_probs"])
    # the same next update: optimizer moments and step counters came back too
    a, b = train_step(engine, data, nll_loss), train_step(fresh, data, nll_loss)
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    assert torch.equal(logprobs(fresh, data)["log_probs"], logprobs(engine, data)["log_probs"])


def _local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if hasattr(p, "to_local") else p).detach()


def test_exports_reproduce_the_trained_policy(dist_group, tmp_path) -> None:
    """What was trained is what ships: the engine's own log-probs (adapters on) equal those of the PEFT adapter
    export loaded with `PeftModel.from_pretrained` onto a freshly built base, and of the merged (`--merge`) export."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hybridflow.checkpoint import CheckpointManager
    from hybridflow.commands.export import export_hf
    from hybridflow.config import to_dict
    from hybridflow.engine.checkpoint import full_model_state, write_hf
    from hybridflow.models.loader import load_module

    cfg = make_config(*LORA)
    engine = make_engine(*LORA)
    data = make_batch(seed=7)
    for _ in range(3):
        train_step(engine, data, nll_loss)
    policy = logprobs(engine, data)["log_probs"]
    base = make_engine()
    assert (policy - logprobs(base, data)["log_probs"]).abs().max() > 1e-3  # the adapters changed the policy
    with CheckpointManager(tmp_path / "ckpt", async_save=False) as mgr:  # as the trainer saves it
        mgr.save(3, {"actor": engine.state_dict()}, extra={"config": to_dict(cfg)})
    adapter_dir = export_hf(tmp_path / "ckpt", tmp_path / "adapter")
    merged_dir = export_hf(tmp_path / "ckpt", tmp_path / "merged", merge=True)
    # the supervised trainers' hand-off: the live engine, merged onto its in-memory base, through the same writer
    live_dir, kind = write_hf(full_model_state(engine.module, 8 / 4), cfg.model, tmp_path / "live")

    peft_model = PeftModel.from_pretrained(load_module(cfg.model, "lm"), str(adapter_dir)).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
    live = AutoModelForCausalLM.from_pretrained(str(live_dir), dtype=torch.float32).eval()
    assert kind == "full"
    params = {n: _local(p) for n, p in engine.module.named_parameters()}
    exported = merged.state_dict()
    for layer in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):  # W + (alpha/r)·B·A, naively
        w, a, b = (params[f"{layer}.{k}.weight"] for k in ("base_layer", "lora_A.default", "lora_B.default"))
        torch.testing.assert_close(exported[f"{layer}.weight"], w + (8 / 4) * b @ a, atol=1e-6, rtol=0)
    for name, model in (("PeftModel.from_pretrained", peft_model), ("merged export", merged), ("live export", live)):
        torch.testing.assert_close(_hf_response_logprobs(model, data), policy, atol=2e-5, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _hf_response_logprobs(model: torch.nn.Module, data) -> torch.Tensor:
    """Log-probs of `data`'s responses under an HF causal LM, laid out as the engine's (zero off the mask)."""
    b = data.batch
    response = b["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits.float()
    logp = torch.log_softmax(logits[:, -response - 1:-1], -1).gather(-1, b["responses"][..., None]).squeeze(-1)
    return logp * b["response_mask"]
