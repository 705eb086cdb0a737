"""Which part of each weight a tensor-parallel generation rank holds: the one slicing rule both the resharding at the
switch (FSDP2 shards → TP slices) and the TP forward read.

Megatron-style split of a Llama-family decoder over `tp` ranks of one generation group:
- column-parallel (output rows split): q/k/v projections by attention heads, gate/up by intermediate rows, the
  embedding and the LM head by vocabulary rows;
- row-parallel (input columns split): o_proj by attention heads, down_proj by intermediate columns — their partial
  outputs are summed across the group (one all-reduce each), and their biases are added once, after the sum;
- replicated: norms (input/post-attention/final, Qwen3's per-head q/k norms) and row-parallel biases.
KV heads: with `num_kv_heads >= tp` each rank holds `num_kv_heads / tp` of them; with fewer KV heads than ranks
(`tp % num_kv_heads == 0`) each KV head is replicated on `tp / num_kv_heads` consecutive ranks, so rank r holds KV
head `r // (tp / num_kv_heads)` — exactly the one its query heads attend with.
Vocabulary: every rank holds `ceil(vocab / tp)` rows; the last rank's rows past `vocab` are zero padding whose
logits the engine masks to -inf.

`param_slice` answers for one Hugging Face parameter name (after PEFT's `base_layer.` is stripped); `local_spec`
gives the per-rank shape facts. Both are pure functions of shapes: no process groups here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from hybridflow.rollout.weights import ArchSpec


@dataclass(frozen=True)
class TPLayout:
    """One rank's place in its generation group: `rank` in [0, size)."""

    size: int
    rank: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.size})")


@dataclass(frozen=True)
class Slice:
    """Rows or columns [start, stop) of `dim`; `pad_to` > stop - start: zero rows appended (the vocab shard)."""

    dim: int
    start: int
    stop: int
    pad_to: int = 0

    @property
    def length(self) -> int:
        return self.stop - self.start


def check_divisible(spec: ArchSpec, intermediate: int, tp: int) -> None:
    """Raise naming the shape and the fix when `tp` cannot split this model."""
    fix = "set rollout.tensor_model_parallel_size to a divisor of both"
    if spec.num_heads % tp:
        raise ValueError(f"num_attention_heads={spec.num_heads} is not divisible by tensor_model_parallel_size={tp}; "
                         f"{fix}")
    if spec.num_kv_heads % tp and tp % spec.num_kv_heads:
        raise ValueError(f"num_key_value_heads={spec.num_kv_heads} and tensor_model_parallel_size={tp}: one must "
                         f"divide the other; {fix}")
    if intermediate % tp:
        raise ValueError(f"intermediate_size={intermediate} is not divisible by tensor_model_parallel_size={tp}; "
                         f"{fix}")


def local_kv_heads(spec: ArchSpec, tp: int) -> int:
    return max(1, spec.num_kv_heads // tp)


def kv_head_start(spec: ArchSpec, layout: TPLayout) -> int:
    """First KV head this rank holds."""
    if spec.num_kv_heads >= layout.size:
        return layout.rank * (spec.num_kv_heads // layout.size)
    return layout.rank // (layout.size // spec.num_kv_heads)


def vocab_range(vocab: int, layout: TPLayout) -> tuple[int, int, int]:
    """(start, stop, shard rows) of this rank's vocabulary shard; stop - start < shard rows on a padded last rank."""
    rows = math.ceil(vocab / layout.size)
    start = min(vocab, layout.rank * rows)
    return start, min(vocab, start + rows), rows


def local_spec(spec: ArchSpec, layout: TPLayout) -> ArchSpec:
    """The shape facts one rank runs with: its query heads, its KV heads, its vocabulary shard's rows."""
    return ArchSpec(num_layers=spec.num_layers, hidden=spec.hidden, num_heads=spec.num_heads // layout.size,
                    num_kv_heads=local_kv_heads(spec, layout.size), head_dim=spec.head_dim,
                    vocab=vocab_range(spec.vocab, layout)[2], eps=spec.eps)


_PROJ = re.compile(r"(?:^|\.)(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.(weight|bias)$")


def param_slice(name: str, shape: torch.Size | tuple[int, ...], spec: ArchSpec, layout: TPLayout) -> Slice | None:
    """The slice of parameter `name` (full shape `shape`) this rank holds; None = the whole tensor (replicated)."""
    tp, r = layout.size, layout.rank
    if tp == 1:
        return None
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        start, stop, rows = vocab_range(shape[0], layout)
        return Slice(0, start, stop, rows)
    m = _PROJ.search(name)
    if m is None:
        return None  # norms (incl. q_norm/k_norm over head_dim)
    proj, kind = m.groups()
    D = spec.head_dim
    if proj == "q_proj":
        per = spec.num_heads // tp * D
        return Slice(0, r * per, (r + 1) * per)
    if proj in ("k_proj", "v_proj"):
        per = local_kv_heads(spec, tp) * D
        start = kv_head_start(spec, layout) * D
        return Slice(0, start, start + per)
    if proj in ("gate_proj", "up_proj"):
        per = shape[0] // tp
        return Slice(0, r * per, (r + 1) * per)
    if kind == "bias":  # o_proj / down_proj bias: added once after the all-reduce
        return None
    per = shape[1] // tp  # o_proj (columns = query heads × D) / down_proj (columns = intermediate)
    return Slice(1, r * per, (r + 1) * per)


def take(full: torch.Tensor, sl: Slice | None) -> torch.Tensor:
    """Reference: this rank's slice of a full tensor (padded vocab rows are zeros). A copy, contiguous."""
    if sl is None:
        return full.clone()
    part = full.narrow(sl.dim, sl.start, sl.length)
    if sl.pad_to > sl.length:
        pad = list(part.shape)
        pad[sl.dim] = sl.pad_to - sl.length
        part = torch.cat([part, part.new_zeros(pad)], dim=sl.dim)
    return part.contiguous()
