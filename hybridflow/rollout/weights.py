"""The generation view of the actor's weights: the same parameter tensors as the HF module, no copy when possible.

Decision (hybrid engine): one device + same dtype → the views *are* the training parameters (an optimizer step is
seen by the next generate for free; `sync_weights` only checks that storage did not move). Different dtype (fp32
master weights, bf16 generation) → cast into reused buffers, once per `sync_weights`. FSDP2 over N ranks → each
FSDP2 group (a decoder layer; the root's embeddings/norm/head) is unsharded in its compute dtype — one bf16
all-gather per layer, not one collective per parameter — copied into reused buffers and resharded (peak = one
extra layer). Where copies are made anyway, q/k/v and gate/up go into one fused buffer each. LoRA: an adapted
matrix is always a copy, W + (alpha/r)·B·A (one small GEMM into its buffer at each build); the others stay as above.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
STACK_BYTES = 256 * 2**20  # the largest temporary stack of adapted weights the LoRA merge makes


@dataclass
class LayerWeights:
    ln1: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    ln2: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # Qwen3: RMSNorm over each head of q and k before RoPE
    k_norm: torch.Tensor | None = None
    # One [q; k; v] and one [gate; up] matrix (q/k/v/gate/up are then row slices of them): fewer, larger matmuls
    # per decode step. Built only when the views are copies anyway (cast or gathered); zero-copy views stay apart.
    qkv: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None
    gate_up: torch.Tensor | None = None


@dataclass
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor
    owned_buffers: bool = False  # True when views are copies (dtype cast or multi-rank gather)
    ptrs: tuple[int, ...] = field(default_factory=tuple)

    def tensors(self) -> list[torch.Tensor]:
        out = [self.embed, self.norm, self.lm_head]
        for lw in self.layers:
            out += [t for t in vars(lw).values() if t is not None]
        return out

    def nbytes(self) -> int:
        """Bytes of distinct storages (a fused matrix and its row slices count once)."""
        seen: dict[int, int] = {}
        for t in self.tensors():
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())


@dataclass(frozen=True)
class ArchSpec:
    """Shape facts the runner needs, read from the HF config."""

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    eps: float


def unsupported_reason(module: nn.Module, max_total_len: int) -> str | None:
    """Why our runner cannot run `module` (None = it can); the HF fallback logs this reason."""
    cfg = getattr(module, "config", None)
    mtype = getattr(cfg, "model_type", None)
    if mtype not in SUPPORTED_MODEL_TYPES:
        return f"model_type={mtype!r} is not one of {SUPPORTED_MODEL_TYPES}"
    inner = getattr(module, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(module, "lm_head"):
        return "module has no .model.layers / .lm_head (not a *ForCausalLM of the Llama family)"
    if getattr(inner, "rotary_emb", None) is None:
        return "module.model has no rotary_emb"
    window = getattr(cfg, "sliding_window", None)
    sliding = "sliding_attention" in (getattr(cfg, "layer_types", None) or [])
    if mtype == "mistral" and window is not None:
        sliding = True
    if sliding and window is not None and window < max_total_len:
        return f"sliding-window attention (window {window} < prompt+response length {max_total_len})"
    mlp = inner.layers[0].mlp
    if getattr(mlp, "gate_proj", None) is None:
        return "MLP is not gate/up/down (SwiGLU)"
    if any(getattr(getattr(mlp, n), "bias", None) is not None for n in ("gate_proj", "up_proj", "down_proj")):
        return "MLP projections have biases"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act={cfg.hidden_act!r} (only silu)"
    return None


def arch_spec(module: nn.Module) -> ArchSpec:
    cfg = module.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return ArchSpec(num_layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, num_heads=cfg.num_attention_heads,
                    num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim, vocab=cfg.vocab_size,
                    eps=float(cfg.rms_norm_eps))


def _is_fsdp(module: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed
        return False
    return isinstance(module, FSDPModule)


def _sharded(module: nn.Module) -> bool:
    """True when the module's own parameters are DTensors over more than one rank."""
    p = next(module.parameters(recurse=False), None)
    if p is None:
        p = next(module.parameters(), None)
    return p is not None and hasattr(p, "to_local") and p.device_mesh.size() > 1


def _source(p: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """(full tensor, is_temporary). A DTensor on one rank is its local shard (zero copy); on N ranks, each shard is
    cast to the generation dtype first and then gathered (bf16 over the wire, not the fp32 master weights)."""
    to_local = getattr(p, "to_local", None)
    if to_local is None:
        return p.detach(), False
    if p.device_mesh.size() == 1:
        return to_local().detach(), False
    return p.detach().to(dtype).full_tensor(), True


def _lora_factors(owner: nn.Module | None) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(B, A, scale) when `owner` is a PEFT LoRA layer with its adapter active; None otherwise (also without PEFT)."""
    if owner is None or not hasattr(owner, "lora_A"):
        return None
    from hybridflow.engine.lora import lora_factors

    return lora_factors(owner)


class WeightView:
    """Builds and refreshes a `ModelWeights` over a module's parameters in the generation dtype."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        self.module, self.dtype, self.device = module, dtype, device
        self._buffers: dict[object, torch.Tensor] = {}  # id(param) or ("fused", id) -> reused generation buffer
        self._gathered: set[object] = set()  # keys whose buffer holds a full (multi-rank) tensor
        self._unsharded = False  # inside `_fsdp_unsharded`: parameters are FSDP's temporary full tensors
        self._parts: dict[object, list[torch.Tensor]] = {}  # fused buffer key -> its row-slice views
        self._pending: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # copies batched into one foreach
        self._deltas: list[tuple[torch.Tensor, nn.Module]] = []  # (buffer holding W, its LoRA layer): += s·B·A
        self._fsdp_modules = [m for m in module.modules() if _is_fsdp(m)]

    def _zero_copy(self, p: torch.Tensor) -> bool:
        if self._unsharded:
            return False
        local = p.to_local() if hasattr(p, "to_local") else p
        single = not hasattr(p, "to_local") or p.device_mesh.size() == 1
        return single and local.dtype == self.dtype and local.device == self.device

    @contextlib.contextmanager
    def _fsdp_unsharded(self, group: nn.Module) -> Iterator[None]:
        """With N ranks, all-gather one FSDP2 group (a decoder layer, or the root's embeddings/norm/head) in a
        single collective in its compute dtype, copy out, and free it again: ~25 bf16 all-gathers per switch instead
        of one per parameter. One rank (or no FSDP): nothing to do."""
        if not (_is_fsdp(group) and _sharded(group)):
            yield
            return
        group.unshard()
        self._unsharded = True
        try:
            yield
            self._flush()  # copy out before the unsharded tensors are freed
        finally:
            self._unsharded = False
            group.reshard()

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._pending[0].append(dst)
        self._pending[1].append(src)

    def _flush(self) -> None:
        """All pending casts/copies as one `_foreach_copy_` (a few kernels instead of one per tensor), then the LoRA
        deltas into the copies (inside `_fsdp_unsharded` the adapters are gathered too, so B and A are whole)."""
        dst, src = self._pending
        if dst:
            torch._foreach_copy_(dst, src)
        self._pending = ([], [])
        self._apply_deltas()

    def _apply_deltas(self) -> None:
        """W += scale·B·A for every pending LoRA delta, batched: deltas of one shape (the same projection in every
        layer) go through one `baddbmm_` over their stacked copies — ~5 kernels per projection instead of ~3 per
        matrix (a 0.5B model with all-linear rank-64 adapters has 168 of them). One rounding per element, as
        `addmm_`: the GEMM accumulates in fp32 and adds W in its epilogue. A stack holds at most STACK_BYTES of
        weights (a 7B model's 56 gate/up matrices would be a 7.6 GB temporary), so the merge needs little memory."""
        groups: dict[tuple, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        for buf, layer in self._deltas:
            b, a, scale = _lora_factors(layer)
            b, a = _source(b, self.dtype)[0], _source(a, self.dtype)[0]
            groups.setdefault((tuple(buf.shape), tuple(b.shape), tuple(a.shape), scale), []).append((buf, b, a))
        self._deltas = []
        for (shape, *_, scale), items in groups.items():
            per_stack = max(1, STACK_BYTES // (math.prod(shape) * self.dtype.itemsize))  # bounded temporary memory
            for i in range(0, len(items), per_stack):
                chunk = items[i: i + per_stack]
                bufs = [buf for buf, _, _ in chunk]
                if len(chunk) == 1:
                    bufs[0].addmm_(chunk[0][1].to(self.dtype), chunk[0][2].to(self.dtype), alpha=scale)
                    continue
                w = torch.stack(bufs)
                w.baddbmm_(torch.stack([b for _, b, _ in chunk]).to(self.dtype),
                           torch.stack([a for _, _, a in chunk]).to(self.dtype), alpha=scale)
                torch._foreach_copy_(bufs, list(w.unbind(0)))

    def _buffer(self, key: object, shape: torch.Size, gathered: bool) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != shape:
            buf = torch.empty(shape, dtype=self.dtype, device=self.device)
            self._buffers[key] = buf
        if gathered:
            self._gathered.add(key)
        return buf

    def _get(self, owner: nn.Module | None, attr: str = "weight") -> torch.Tensor | None:
        """`owner.<attr>` in the generation dtype: the parameter itself when possible, else a reused buffer keyed by
        (owner, attr) — stable across steps, unlike FSDP's temporary unsharded tensors."""
        p = getattr(owner, attr, None) if owner is not None else None
        if p is None:
            return None
        src, temporary = _source(p, self.dtype)
        temporary = temporary or self._unsharded
        adapted = attr == "weight" and _lora_factors(owner) is not None
        if not temporary and not adapted and src.dtype == self.dtype and src.device == self.device:
            return src  # zero copy: the training parameter itself
        buf = self._buffer((id(owner), attr), src.shape, temporary)
        if temporary and not self._unsharded:
            buf.copy_(src)  # a parameter gathered on its own is copied and freed at once
        else:
            self._copy(buf, src)
        if adapted:
            self._deltas.append((buf, owner))
        return buf

    def _get_fused(self, owners: list[nn.Module], attr: str = "weight"
                   ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """(fused buffer, row-slice views) when every part needs a copy anyway; else (None, plain `_get`s)."""
        params = [getattr(o, attr, None) for o in owners]
        adapted = [attr == "weight" and _lora_factors(o) is not None for o in owners]
        if any(p is None for p in params) or (not any(adapted) and any(self._zero_copy(p) for p in params)):
            return None, [self._get(o, attr) for o in owners]
        rows = [p.shape[0] for p in params]
        key = ("fused", id(owners[0]), attr)
        buf = self._buffer(key, torch.Size([sum(rows), *params[0].shape[1:]]),
                           gathered=not all(self._zero_copy_shape(p) for p in params))
        parts = self._parts.get(key)
        if parts is None or parts[0].data_ptr() != buf.data_ptr():
            parts = self._parts[key] = list(buf.split(rows, dim=0))
        for p, part, owner, lora in zip(params, parts, owners, adapted):
            src, temporary = _source(p, self.dtype)
            if temporary and not self._unsharded:
                part.copy_(src)
            else:
                self._copy(part, src)
            if lora:
                self._deltas.append((part, owner))
        return buf, parts

    def _zero_copy_shape(self, p: torch.Tensor) -> bool:
        """True when the parameter is whole on this rank (not a shard that had to be gathered)."""
        return not self._unsharded and (not hasattr(p, "to_local") or p.device_mesh.size() == 1)

    def _layer(self, layer: nn.Module) -> LayerWeights:
        att, mlp = layer.self_attn, layer.mlp
        qkv, (q, k, v) = self._get_fused([att.q_proj, att.k_proj, att.v_proj])
        if qkv is not None and all(o.bias is not None for o in (att.q_proj, att.k_proj, att.v_proj)):
            qkv_bias, (qb, kb, vb) = self._get_fused([att.q_proj, att.k_proj, att.v_proj], "bias")
        else:
            qkv_bias, (qb, kb, vb) = None, [self._get(o, "bias") for o in (att.q_proj, att.k_proj, att.v_proj)]
        gate_up, (gate, up) = self._get_fused([mlp.gate_proj, mlp.up_proj])
        return LayerWeights(
            ln1=self._get(layer.input_layernorm), ln2=self._get(layer.post_attention_layernorm),
            q=q, k=k, v=v, o=self._get(att.o_proj), q_bias=qb, k_bias=kb, v_bias=vb,
            o_bias=self._get(att.o_proj, "bias"), q_norm=self._get(getattr(att, "q_norm", None)),
            k_norm=self._get(getattr(att, "k_norm", None)), gate=gate, up=up, down=self._get(mlp.down_proj),
            qkv=qkv, qkv_bias=qkv_bias, gate_up=gate_up)

    def build(self) -> ModelWeights:
        """Refresh all views (cheap when zero-copy) and return them; `ptrs` tells callers if storage moved."""
        for fsdp_module in self._fsdp_modules:  # unsharded leftovers of a forward: we read (or gather) the shards
            fsdp_module.reshard()
        m = self.module
        inner = m.model
        tied = m.lm_head.weight is inner.embed_tokens.weight
        layers = []
        for layer in inner.layers:
            with self._fsdp_unsharded(layer):
                layers.append(self._layer(layer))
        with self._fsdp_unsharded(m):
            embed = self._get(inner.embed_tokens)
            lm_head = embed if tied else self._get(m.lm_head)  # tied: one gather/cast, not two
            norm = self._get(inner.norm)
        self._flush()
        weights = ModelWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head,
                               owned_buffers=bool(self._buffers))
        weights.ptrs = tuple(t.data_ptr() for t in weights.tensors())
        return weights

    def release(self) -> None:
        """Drop the gathered full-weight buffers (N ranks); keep one-rank dtype-cast buffers, which are smaller
        than the fp32 master weights they mirror and make the next switch a plain copy with no allocation."""
        for key in self._gathered:
            self._buffers.pop(key, None)
        self._gathered.clear()
