import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridflow.config import load_config
from hybridflow.engine.flops import FlopsCounter, matmul_params
from hybridflow.engine.optim import lr_factor
from hybridflow.models import preset_config


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "qwen2.5-1.5b"])
def test_matmul_params_match_model_weights(name):
    cfg = preset_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    # All 2-D weights except the embedding table are matmuls (tied: lm_head is the embedding, counted once more).
    mats = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and "embed_tokens" not in n)
    assert matmul_params(cfg, with_lm_head=False) == mats
    assert matmul_params(cfg) == mats + cfg.vocab_size * cfg.hidden_size
    total = sum(p.numel() for p in model.parameters())
    assert total == pytest.approx({"qwen2.5-0.5b": 494e6, "qwen2.5-1.5b": 1.54e9}[name], rel=0.01)


def test_train_flops_formula():
    cfg = preset_config("tiny")
    counter = FlopsCounter(cfg)
    n = matmul_params(cfg)
    d = cfg.num_hidden_layers * cfg.hidden_size
    assert counter.train_flops([3, 5]) == 6 * n * 8 + 6 * d * (9 + 25)
    body = matmul_params(cfg, with_lm_head=False)
    assert counter.train_flops([3, 5], head_tokens=2) == 6 * (body * 8 + (n - body) * 2) + 6 * d * (9 + 25)
    assert counter.forward_flops([4]) == pytest.approx(counter.train_flops([4]) / 3)


def test_lora_flops_count_no_weight_gradients_for_the_frozen_base():
    cfg = preset_config("tiny")
    full, lora = FlopsCounter(cfg), FlopsCounter(cfg, adapter_params=1000)
    n, d = matmul_params(cfg), cfg.num_hidden_layers * cfg.hidden_size
    attn = 6 * d * (9 + 25)
    assert lora.train_flops([3, 5]) == 4 * n * 8 + 6 * 1000 * 8 + attn
    assert lora.train_flops([3, 5]) < full.train_flops([3, 5])
    assert lora.forward_flops([3, 5]) == pytest.approx(2 * (n + 1000) * 8 + attn / 3)


def test_lr_factor_constant_and_warmup_ratio():
    optim = load_config(files=[], overrides=["actor.optim.lr_scheduler=constant"]).actor.optim
    assert [lr_factor(s, optim, 4, None) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = load_config(files=[], overrides=["actor.optim.lr_scheduler=cosine"]).actor.optim
    assert lr_factor(5, cos, 0, 10) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
