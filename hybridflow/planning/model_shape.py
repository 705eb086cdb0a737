"""A decoder's shape (Llama / Qwen2 family, GQA) read from config.json or a preset, and its parameter tensors.

Decision: the planner counts bytes from the list of parameter tensors, not from a parameter total, because FSDP2
shards each tensor on dim 0 with `torch.chunk` (the first ranks get ceil(rows / world) rows, the last ones fewer or
none): the per-rank byte count is then exact, which a total divided by the world size is not.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from hybridflow.config import ConfigError
from hybridflow.config.schema import ModelConfig

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    vocab: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelShape:
        cfg = cfg.get("text_config", cfg)
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        model_type = str(cfg.get("model_type", "llama"))
        return cls(layers=int(cfg["num_hidden_layers"]), hidden=hidden, heads=heads,
                   kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or hidden // heads), inter=int(cfg["intermediate_size"]),
                   vocab=int(cfg["vocab_size"]), tied=bool(cfg.get("tie_word_embeddings", False)),
                   qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)))

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each decoder-layer Linear, by HF name."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.inter
        return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
                "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}

    def param_shapes(self, head: str = "lm") -> list[tuple[int, ...]]:
        """Every parameter tensor of the HF model, in order; `head` = lm (causal LM) or value (scalar head)."""
        layer: list[tuple[int, ...]] = []
        for name, (out, inp) in self.linear_shapes().items():
            layer.append((out, inp))
            if self.qkv_bias and name in ("q_proj", "k_proj", "v_proj"):
                layer.append((out,))
        layer += [(self.hidden,), (self.hidden,)]  # input_layernorm, post_attention_layernorm
        shapes: list[tuple[int, ...]] = [(self.vocab, self.hidden), *layer * self.layers, (self.hidden,)]
        if head == "value":
            shapes.append((1, self.hidden))
        elif not self.tied:
            shapes.append((self.vocab, self.hidden))
        return shapes

    def params(self, head: str = "lm") -> int:
        return sum(math.prod(s) for s in self.param_shapes(head))

    def decoder_linear_params(self) -> int:
        return self.layers * sum(o * i for o, i in self.linear_shapes().values())

    def lora_shapes(self, rank: int, targets: tuple[str, ...]) -> list[tuple[int, int]]:
        """LoRA A [r, in] and B [out, r] of every adapted Linear (all-linear = every decoder Linear)."""
        out: list[tuple[int, int]] = []
        for name, (o, i) in self.linear_shapes().items():
            if name in targets:
                out += [(rank, i), (o, rank)]
        return out * self.layers


def tp_slice_numel(shape: ModelShape, tp: int) -> int:
    """Elements of the weight slices one rank of a tensor-parallel generation group holds, by rollout/tp_layout.py's
    rule: q/k/v/gate/up rows and o/down columns split `tp` ways, KV heads replicated when fewer than `tp`, vocabulary
    rows ceil(vocab / tp) (zero-padded on the last rank), norms whole; `tp` = 1: the whole model."""
    h, d = shape.hidden, shape.head_dim
    q, kv, inter = shape.heads // tp * d, max(1, shape.kv_heads // tp) * d, shape.inter // tp
    layer = 2 * q * h + 2 * kv * h + 3 * inter * h + 2 * h + ((q + 2 * kv) if shape.qkv_bias else 0)
    vocab = -(-shape.vocab // tp) * h
    return shape.layers * layer + vocab * (1 if shape.tied else 2) + h


def shard_numel(shapes: list[tuple[int, ...]], world: int, rank: int) -> int:
    """Elements of `rank`'s FSDP2 Shard(0) chunks of `shapes` (torch.chunk: ceil(rows / world) rows per rank)."""
    total = 0
    for shape in shapes:
        rows = shape[0]
        per = -(-rows // world)
        mine = max(0, min(per, rows - rank * per))
        total += mine * math.prod(shape[1:])
    return total


def max_shard_numel(shapes: list[tuple[int, ...]], world: int) -> int:
    """The largest rank's shard (rank 0's: torch.chunk gives the first ranks the full chunks)."""
    return shard_numel(shapes, world, 0)


def lora_targets(cfg: ModelConfig) -> tuple[str, ...]:
    t = cfg.lora.target_modules
    return LINEAR_NAMES if t == "all-linear" else tuple(x for x in t if x in LINEAR_NAMES)


def read_config_json(path: str) -> dict[str, Any]:
    """`path`'s config.json (a local directory or a cached Hugging Face id); ConfigError naming the fix if absent."""
    from hybridflow.models.loader import resolve_path

    try:
        file = resolve_path(path) / "config.json"
    except ValueError as err:  # an id not in the local cache: the message says how to fetch it
        raise ConfigError(str(err)) from None
    if not file.is_file():
        raise ConfigError(f"model path {path!r}: no config.json at {file}; point model.path (or critic.model_path, "
                          "teacher.model_path) at a Hugging Face model directory or a cached model id, or use "
                          "model.preset")
    return json.loads(file.read_text())


def read_shape(model: ModelConfig, path: str | None = None) -> ModelShape:
    """The shape of `path` (default model.path; its config.json, a cached Hugging Face id too) or of model.preset,
    with model.override_config applied. Never downloads."""
    override = dict(model.override_config or {})
    path = path or model.path
    if path:
        cfg = read_config_json(str(path))
        cfg.update(override)
    else:
        from hybridflow.models.presets import preset_config

        cfg = preset_config(model.preset, **override).to_dict()
    return ModelShape.from_hf(cfg)
