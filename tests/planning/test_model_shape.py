"""Model shapes from a model directory's config.json (Llama: no q/k/v bias) and the error for a missing one."""

import json

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from hybridflow.config import ConfigError, load_config
from hybridflow.planning.model_shape import ModelShape, read_shape

LLAMA = dict(vocab_size=101, hidden_size=48, intermediate_size=70, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, tie_word_embeddings=False)


def test_llama_config_json_counts_every_parameter(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "model_type": "llama"}))
    shape = read_shape(load_config(overrides=[f"model.path={tmp_path}"], validate=False).model)
    assert shape == ModelShape.from_hf({**LLAMA, "model_type": "llama"}) and not shape.qkv_bias
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    assert shape.param_shapes() == [tuple(p.shape) for p in model.parameters()]


def test_missing_config_json_names_the_key(tmp_path):
    cfg = load_config(overrides=[f"model.path={tmp_path}"], validate=False)
    with pytest.raises(ConfigError, match="no config.json.*model.preset"):
        read_shape(cfg.model)
