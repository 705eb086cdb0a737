"""Loading and saving HF models and tokenizers: round trips, critic/reward heads, errors."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForSequenceClassification

from hybridflow.config import load_config
from hybridflow.models import load_model, load_tokenizer, save_pretrained


def _model_cfg(*overrides):
    return load_config(files=[], overrides=list(overrides)).model


@pytest.fixture(scope="module")
def actor_dir(tmp_path_factory):
    cfg = _model_cfg()
    out = tmp_path_factory.mktemp("actor")
    save_pretrained(load_model(cfg, "actor"), out, load_tokenizer(cfg))
    return out


def test_presets_are_seeded_and_actor_ref_identical():
    a, b = load_model(_model_cfg(), "actor"), load_model(_model_cfg(), "ref")
    c = load_model(_model_cfg("model.seed=1"), "actor")
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_tiny_moe_preset_builds_a_qwen3_moe_the_engine_decodes():
    from hybridflow.rollout.moe import unsupported_reason

    model = load_model(_model_cfg("model.preset=tiny-moe", "model.override_config={hidden_size: 128}"), "actor")
    cfg = model.config
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == ("qwen3_moe", 8, 2, True)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (128, 128)  # head_dim follows the hidden size
    assert cfg.pad_token_id == 0 and unsupported_reason(model) is None


def test_save_then_load_round_trip(actor_dir):
    original = load_model(_model_cfg(), "actor")
    loaded = load_model(_model_cfg(f"model.path={actor_dir}"), "actor")
    hf = AutoModelForCausalLM.from_pretrained(actor_dir)
    ids = torch.randint(3, 90, (2, 7))
    with torch.no_grad():
        ref = original(input_ids=ids).logits
        torch.testing.assert_close(loaded(input_ids=ids).logits, ref, atol=0, rtol=0)
        torch.testing.assert_close(hf(input_ids=ids).logits, ref, atol=1e-6, rtol=1e-6)
    # Ours and plain AutoTokenizer (which rebuilds it as Qwen2Tokenizer next to a qwen2 config.json) agree.
    tok = load_tokenizer(_model_cfg(f"model.path={actor_dir}"))
    auto = AutoTokenizer.from_pretrained(actor_dir)
    text = "User: 12+7=?\nAssistant: 19<|endoftext|>"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert auto(text)["input_ids"] == tok(text)["input_ids"] and auto.decode(auto(text)["input_ids"]) == text
    assert tok.pad_token == "<|pad|>" and tok.padding_side == "left"


def test_loading_draws_no_progress_bar_and_leaves_the_setting(actor_dir, capfd):
    from transformers.utils import logging as hf_logging

    capfd.readouterr()
    load_model(_model_cfg(f"model.path={actor_dir}"), "actor")
    load_model(_model_cfg(f"model.path={actor_dir}"), "critic")
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()  # only silenced during our loads


def test_critic_from_actor_dir_shares_the_backbone(actor_dir):
    actor = load_model(_model_cfg(f"model.path={actor_dir}"), "actor")
    critic = load_model(_model_cfg(f"model.path={actor_dir}"), "critic")
    assert critic.score.weight.shape == (1, actor.config.hidden_size) and critic.score.bias is None
    for name, p in actor.model.named_parameters():
        assert torch.equal(p, dict(critic.model.named_parameters())[name]), name


def test_reward_model_loads_a_sequence_classification_checkpoint(tmp_path, actor_dir):
    cfg = AutoModelForCausalLM.from_pretrained(actor_dir).config
    cfg.num_labels = 1
    torch.manual_seed(0)
    rm = Qwen2ForSequenceClassification(cfg)
    rm.save_pretrained(tmp_path)
    ours = load_model(_model_cfg(), "reward", path=str(tmp_path))
    torch.testing.assert_close(ours.score.weight, rm.score.weight, atol=0, rtol=0)
    ids = torch.randint(3, 90, (3, 6))
    with torch.no_grad():
        # No padding: HF pools the last token; our per-token head at the last position must equal it.
        torch.testing.assert_close(ours(input_ids=ids).logits[:, -1, 0], rm(input_ids=ids).logits[:, 0],
                                   atol=1e-5, rtol=1e-5)


def test_bad_path_and_role_errors(tmp_path, actor_dir):
    with pytest.raises(ValueError, match="model.path"):
        load_model(_model_cfg(f"model.path={tmp_path}"), "actor")
    with pytest.raises(ValueError, match="role"):
        load_model(_model_cfg(), "policy")
    with pytest.raises(ValueError, match="override_config.no_such_field"):
        load_model(_model_cfg(f"model.path={actor_dir}", "model.override_config={no_such_field: 1}"), "actor")


def test_hf_model_id_resolves_through_the_local_cache_only(actor_dir, tmp_path, monkeypatch):
    """`model.path=org/name` loads the cached snapshot (`local_files_only`); an uncached id is a clear error that
    says how to fetch it — never a download (the hub endpoint is made unreachable here)."""
    import shutil

    from huggingface_hub import constants

    snapshot = tmp_path / "hub" / "models--acme--tiny-chat" / "snapshots" / "0123abcd"
    shutil.copytree(actor_dir, snapshot)
    (tmp_path / "hub" / "models--acme--tiny-chat" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny-chat" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    cfg = _model_cfg("model.path=acme/tiny-chat")
    model = load_model(cfg, "actor")
    ref = AutoModelForCausalLM.from_pretrained(str(actor_dir))
    assert torch.equal(model.lm_head.weight, ref.lm_head.weight)
    assert load_tokenizer(cfg).encode("1+2") == load_tokenizer(_model_cfg()).encode("1+2")
    with pytest.raises(ValueError, match=r"model.path='acme/not-cached'.*local Hugging Face cache.*hf download"):
        load_model(_model_cfg("model.path=acme/not-cached"), "actor")
