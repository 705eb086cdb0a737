"""FLOP counts for MFU: 6·N·tokens for the dense matmuls plus the causal attention term, per sequence length.

Assumptions (stated so MFU numbers are comparable): N counts the decoder matmul weights (not the embedding
lookup); the output head (vocab × hidden) counts only for the tokens it is applied to (response tokens: the
engine never computes logits for prompt tokens); attention adds 6·layers·(heads·head_dim)·s² per sequence of length s for forward +
backward (half of 12·L·d·s², since the mask is causal); recomputation (activation checkpointing) is not counted.
Frozen weights (LoRA) need no weight gradients: a matmul costs 2 FLOPs per weight and token forward, 2 for the input
gradient and 2 more only where the weight trains — 4·N·tokens for the frozen base plus 6·A·tokens for A adapter
weights (the adapter matmuls run in every token's forward), instead of 6·N.
Peak: 989 TFLOP/s bf16 dense for H100/H200 (override with HYBRIDFLOW_PEAK_TFLOPS); none on CPU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from transformers import PretrainedConfig

H100_H200_BF16_DENSE = 989e12


def matmul_params(cfg: PretrainedConfig, with_lm_head: bool = True) -> int:
    """Matmul parameters of the language model (a vision-language model's vision tower is not counted)."""
    cfg = cfg.get_text_config()
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q = cfg.num_attention_heads * head_dim
    kv = cfg.num_key_value_heads * head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter
    return layers * per_layer + (cfg.vocab_size * h if with_lm_head else 0)


class FlopsCounter:
    """Training and forward FLOPs of a batch given its sequence lengths."""

    def __init__(self, cfg: PretrainedConfig, with_lm_head: bool = True, adapter_params: int | None = None) -> None:
        """`adapter_params`: None = every matmul weight trains; else the base is frozen and this many adapter
        (LoRA) weights train."""
        self.n = matmul_params(cfg, with_lm_head=False)
        cfg = cfg.get_text_config()
        self.head = cfg.vocab_size * cfg.hidden_size if with_lm_head else 0
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.attn_width = cfg.num_hidden_layers * cfg.num_attention_heads * head_dim
        self.adapters = adapter_params or 0
        self.base_factor = 6.0 if adapter_params is None else 4.0  # fwd + input grad (+ weight grad)

    def train_flops(self, seqlens: Sequence[int], head_tokens: int | None = None) -> float:
        """Forward + backward FLOPs; `head_tokens` = tokens the output head runs on (default: all)."""
        tokens = sum(seqlens)
        head_tokens = tokens if head_tokens is None else head_tokens
        weights = self.base_factor * (self.n * tokens + self.head * head_tokens) + 6.0 * self.adapters * tokens
        return weights + 6.0 * self.attn_width * sum(s * s for s in seqlens)

    def forward_flops(self, seqlens: Sequence[int], head_tokens: int | None = None) -> float:
        tokens = sum(seqlens)
        head_tokens = tokens if head_tokens is None else head_tokens
        weights = 2.0 * (self.n * tokens + self.head * head_tokens + self.adapters * tokens)
        return weights + 2.0 * self.attn_width * sum(s * s for s in seqlens)


def peak_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of one device, or None when unknown (CPU)."""
    env = os.environ.get("HYBRIDFLOW_PEAK_TFLOPS")
    if env:
        return float(env) * 1e12
    if device.type != "cuda":
        return None
    return H100_H200_BF16_DENSE
