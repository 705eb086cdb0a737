"""Random-init model presets: `tiny` / `tiny-moe` for tests and CPU runs, and the published Qwen2.5 shapes for benchmarks.

Presets build an HF `Qwen2Config` (`tiny-moe`: a `Qwen3MoeConfig`; no download). Qwen2.5-0.5B/1.5B/7B dimensions are the published ones
(7B's vocab is 152064 as published; the smaller two use 151936).
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig, Qwen2Config, Qwen3MoeConfig

from hybridflow.models.tiny_vl import PRESET as VL_PRESET
from hybridflow.models.tiny_vl import tiny_vl_config
from hybridflow.models.tokenizer import _vocab

_QWEN_COMMON: dict[str, Any] = dict(
    hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
    attention_dropout=0.0, use_sliding_window=False,
)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=-1,  # filled with the built-in tokenizer's vocab size
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, hidden_act="silu", max_position_embeddings=1024,
        rms_norm_eps=1e-6, rope_theta=10000.0, attention_dropout=0.0,
    ),
    # `tiny`'s attention with a Qwen3-MoE block: 8 experts, 2 per token (renormalised), expert width 64
    "tiny-moe": dict(
        model_type="qwen3_moe", vocab_size=-1, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        norm_topk_prob=True, tie_word_embeddings=False, hidden_act="silu", max_position_embeddings=1024,
        rms_norm_eps=1e-6, rope_theta=10000.0, attention_dropout=0.0,
    ),
    "qwen2.5-0.5b": dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, tie_word_embeddings=True, **_QWEN_COMMON,
    ),
    "qwen2.5-1.5b": dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, tie_word_embeddings=True, **_QWEN_COMMON,
    ),
    "qwen2.5-7b": dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, tie_word_embeddings=False, **_QWEN_COMMON,
    ),
}


_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {"qwen2": Qwen2Config, "qwen3_moe": Qwen3MoeConfig}


def preset_config(name: str, **overrides: Any) -> PretrainedConfig:
    """HF config for a preset; `overrides` (e.g. num_hidden_layers=2) win. Unknown name → ValueError listing presets.
    `tiny-vl` is the vision-language preset (`tiny_vl.py`; its overrides go to the text model)."""
    if name == VL_PRESET:
        return tiny_vl_config(**overrides)
    if name not in PRESETS:
        raise ValueError(f"model.preset={name!r} is not a preset; choose one of {', '.join([*PRESETS, VL_PRESET])}")
    kw = dict(PRESETS[name])
    if kw["vocab_size"] == -1:
        kw["vocab_size"] = len(_vocab())
    kw.update(overrides)
    tok = _vocab()
    cfg = _CONFIG_CLASSES[kw.pop("model_type", "qwen2")](**kw)
    # Special ids of the built-in tokenizer; they are valid ids in every preset's vocab.
    cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = tok["<|pad|>"], tok["<|endoftext|>"], tok["<|bos|>"]
    return cfg
