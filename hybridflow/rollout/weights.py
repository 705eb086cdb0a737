"""The generation view of the actor's weights: the same parameter tensors as the HF module, no copy when possible.

Decision (hybrid engine): one device + same dtype → the views *are* the training parameters (an optimizer step is
seen by the next generate for free; `sync_weights` only checks that storage did not move). Different dtype (fp32
master weights, bf16 generation) → cast into reused buffers, once per `sync_weights`. FSDP2 over N ranks → each
FSDP2 group (a decoder layer; the root's embeddings/norm/head) is unsharded in its compute dtype — one bf16
all-gather per layer, not one collective per parameter — copied into reused buffers and resharded (peak = one
extra layer). Where copies are made anyway, q/k/v and gate/up go into one fused buffer each, and the buffers of one
projection in every decoder layer are slices of one persistent [layers, ...] stack. LoRA: an adapted matrix is always
a copy, W + (alpha/r)·B·A, merged in place: W is copied into its slice of the stack, then one `baddbmm_` per
projection adds the deltas of all layers to a strided view of the stack (no stacking or unstacking of weights); the
others stay as above. One rank: the first build records what it read and ran (`build_plan.py`); later builds check
the sources are unchanged and replay the ops (~0.2 ms of checks instead of a ~5 ms model walk at 0.5B with LoRA).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from hybridflow.rollout import moe as moe_ops
from hybridflow.rollout.build_plan import ADD_ONE, ADDMM, COPY, STACKED, BuildPlan, Recorder
from hybridflow.rollout.vision import VL_MODEL_TYPES

if TYPE_CHECKING:  # tp_layout reads ArchSpec from here
    from hybridflow.rollout.tp_layout import TPLayout

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3_text", *moe_ops.MOE_MODEL_TYPES)
# Their HF modules hold one fused qkv_proj and gate_up_proj ([q; k; v] and [gate; up] rows) per layer.
FUSED_PROJ_TYPES = ("phi3",)
# Gemma-3 (text): (1 + w) RMSNorms (kept in fp32, `forward.rms_norm`), also on the attention and MLP outputs
# (`post_attn_norm`, `post_mlp_norm`), embedding × sqrt(hidden), scale query_pre_attn_scalar**-0.5, GELU-tanh, and
# RoPE bases per layer type (`forward.RopeTable`).
GEMMA_TYPES = ("gemma3_text",)


def _not_ported(cfg: object) -> str | None:
    """What a Gemma config asks that the decode pieces do not compute (soft-capped logits: no SDPA or kernel form)."""
    mtype = getattr(cfg, "model_type", None)
    if mtype not in ("gemma2", *GEMMA_TYPES):
        return None
    caps = {k: getattr(cfg, k, None) for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    caps = {k: v for k, v in caps.items() if v is not None}
    if caps:
        return f"soft-capped logits {caps} (neither SDPA nor the range-attention kernel computes them)"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "use_bidirectional_attention=True (the engine decodes causally)"
    if mtype == "gemma2":
        return "model_type='gemma2' is not ported (Gemma-2 checkpoints soft-cap attention logits)"
    return None
Factors = tuple[torch.Tensor, torch.Tensor, float]  # a LoRA layer's (B [out, r], A [r, in], alpha/r)
STACK_BYTES = 256 * 2**20  # the most temporary memory (stacked LoRA factors B, A) the merge allocates at a time


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
    moe: moe_ops.MoEWeights | None = None  # an MoE layer (gate/up/down are then None)
    # rollout.quantization=fp8 (`fp8.py`): qkv, o, gate_up and down are float8_e4m3fn with these fp32 scales, one per
    # output row; None = plain weights in the generation dtype.
    qkv_scale: torch.Tensor | None = None
    o_scale: torch.Tensor | None = None
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    # Gemma: RMSNorms of the attention output and of the MLP output before their residual adds (ln2 is then the
    # pre-MLP norm); the MLP's activation is GELU-tanh instead of SiLU
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None
    gelu_tanh: bool = False


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
            out += [t for t in vars(lw).values() if isinstance(t, torch.Tensor)]
            out += lw.moe.tensors() if lw.moe is not None else []
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
    attn_scale: float | None = None  # softmax scale of q·k; None = 1/sqrt(head_dim)
    embed_scale: float | None = None  # Gemma: the embedding times sqrt(hidden), rounded to the generation dtype
    fused_proj: bool = False  # the HF module's own q/k/v and gate/up are one matrix each (FUSED_PROJ_TYPES)


def text_parts(module: nn.Module) -> tuple[nn.Module | None, object]:
    """(the decoder backbone holding layers / embed_tokens / norm / rotary_emb, its config): `module.model` and
    `module.config` for a causal LM; the language model and text config of a vision-language model."""
    cfg = getattr(module, "config", None)
    inner = getattr(module, "model", None)
    if getattr(cfg, "vision_config", None) is not None and hasattr(inner, "language_model"):
        return inner.language_model, cfg.get_text_config()
    return inner, cfg


def unsupported_reason(module: nn.Module, max_total_len: int) -> str | None:
    """Why our runner cannot run `module` (None = it can); the HF fallback logs this reason."""
    cfg = getattr(module, "config", None)
    mtype = getattr(cfg, "model_type", None)
    if getattr(cfg, "vision_config", None) is not None:
        if mtype not in VL_MODEL_TYPES:
            return f"model_type={mtype!r} is a vision-language model other than {VL_MODEL_TYPES}"
        mtype = "qwen2"  # its language model is a Qwen2 decoder (with the multimodal RoPE of rollout/vision.py)
    inner, cfg = text_parts(module)
    not_ported = _not_ported(cfg)
    if not_ported is not None:
        return f"model_type={mtype!r}: {not_ported}"
    if mtype not in SUPPORTED_MODEL_TYPES:
        return f"model_type={mtype!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if inner is None or not hasattr(inner, "layers") or not hasattr(module, "lm_head"):
        return "module has no .model.layers / .lm_head (not a *ForCausalLM of the Llama family)"
    if getattr(inner, "rotary_emb", None) is None:
        return "module.model has no rotary_emb"
    window = getattr(cfg, "sliding_window", None)
    sliding = "sliding_attention" in (getattr(cfg, "layer_types", None) or [])
    if mtype in ("mistral", "mixtral", "phi3") and window is not None:  # every layer, when set
        sliding = True
    if sliding and window is not None and window < max_total_len:
        return f"sliding-window attention (window {window} < prompt+response length {max_total_len})"
    if mtype in FUSED_PROJ_TYPES:  # transformers 5: rope_parameters; 4.x: rope_scaling and partial_rotary_factor
        key = "rope_parameters" if getattr(cfg, "rope_parameters", None) is not None else "rope_scaling"
        rope = dict(getattr(cfg, key, None) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0)
        if rope_type != "default" or partial != 1.0:
            return (f"{key}={rope} (rope_type {rope_type!r}, partial_rotary_factor {partial}): {mtype} runs "
                    "natively with the default RoPE over the whole head only (longrope switches frequencies with "
                    "the sequence length)")
    if mtype in GEMMA_TYPES and not getattr(inner.rotary_emb, "layer_types", None):
        return ("this transformers version keeps Gemma-3's local RoPE in a module of its own (rotary_emb_local); "
                "the engine reads one rotary embedding that takes the layer type (transformers >= 5)")
    projs = ("gate_up_proj", "down_proj") if mtype in FUSED_PROJ_TYPES else ("gate_proj", "up_proj", "down_proj")
    mlp = next((layer.mlp for layer in inner.layers if not moe_ops.is_moe_layer(layer.mlp)), None)
    if mlp is not None and any(getattr(mlp, n, None) is None for n in projs):
        return f"MLP is not {'/'.join(projs)} (SwiGLU)"
    if mlp is not None and any(getattr(getattr(mlp, n), "bias", None) is not None for n in projs):
        return "MLP projections have biases"
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    if act != ("gelu_pytorch_tanh" if mtype in GEMMA_TYPES else "silu"):
        return f"hidden activation {act!r} (silu; gelu_pytorch_tanh for Gemma)"
    if inner is not getattr(module, "model", None):  # a vision-language model's Qwen2 decoder: dense MLPs
        return None
    return moe_ops.unsupported_reason(module)


def check_parallel(module: nn.Module, rollout_cfg: object) -> None:
    """Raise when tensor parallelism cannot split this model: MoE layers, fused q/k/v and gate/up projections."""
    moe_ops.check_parallel(module, rollout_cfg)
    tp = getattr(rollout_cfg, "tensor_model_parallel_size", 1)
    mtype = getattr(module.config, "model_type", None)
    if tp > 1 and mtype in (*FUSED_PROJ_TYPES, *GEMMA_TYPES):
        raise ValueError(f"rollout.tensor_model_parallel_size={tp} with {mtype}: tensor parallelism covers the "
                         "Llama family's separate projections and norms only; set rollout.tensor_model_parallel_size=1")


def arch_spec(module: nn.Module, dtype: torch.dtype = torch.float32) -> ArchSpec:
    cfg = text_parts(module)[1]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    gemma = cfg.model_type in GEMMA_TYPES
    # as HF: an fp32 buffer of sqrt(hidden), cast to the weights' dtype before the multiply
    embed_scale = float(torch.tensor(cfg.hidden_size**0.5).to(dtype)) if gemma else None
    return ArchSpec(num_layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, num_heads=cfg.num_attention_heads,
                    num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim, vocab=cfg.vocab_size,
                    eps=float(cfg.rms_norm_eps), attn_scale=cfg.query_pre_attn_scalar**-0.5 if gemma else None,
                    embed_scale=embed_scale, fused_proj=cfg.model_type in FUSED_PROJ_TYPES)


# The name of a decoder parameter from `layers.` / `embed_tokens.` / `norm.` / `lm_head.` on, whatever wraps it.
_LOCAL_NAME = re.compile(r"(?:^|\.)((?:layers\.\d+|embed_tokens|norm|lm_head)\.[\w.]+)$")


def tp_model_weights(local: Mapping[str, torch.Tensor], spec: ArchSpec, layout: TPLayout, dtype: torch.dtype,
                     device: torch.device) -> ModelWeights:
    """`ModelWeights` of one tensor-parallel rank from its slices {HF parameter name: local tensor} (PEFT's
    `base_layer.` stripped, LoRA merged; slices as `tp_layout.param_slice` cuts them, e.g. by the resharding or
    `tensor_parallel.reference_slices`). `spec` is the whole model's. Tensors already in `dtype` on `device` are
    used as they are (the caller's storage: hand the same tensors each switch and CUDA graphs stay valid); tied
    embeddings (no `lm_head.weight`) share the embedding shard."""
    byname = {}
    for name, t in local.items():
        m = _LOCAL_NAME.search(name.replace("base_layer.", ""))
        if m is not None:
            byname[m.group(1)] = t

    def get(name: str, required: bool = True) -> torch.Tensor | None:
        t = byname.get(name)
        if t is None and required:
            raise KeyError(f"tp_model_weights: no slice named ...{name} among {len(local)} tensors")
        return None if t is None else t.detach().to(device=device, dtype=dtype)

    q_rows = spec.num_heads // layout.size * spec.head_dim
    if get("layers.0.self_attn.q_proj.weight").shape[0] != q_rows:
        raise ValueError(f"q_proj slice has {byname['layers.0.self_attn.q_proj.weight'].shape[0]} rows; rank "
                         f"{layout.rank} of {layout.size} holds {q_rows} (tp_layout.param_slice cuts the slices)")
    layers = []
    for i in range(spec.num_layers):
        a, f = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        layers.append(LayerWeights(
            ln1=get(f"layers.{i}.input_layernorm.weight"), ln2=get(f"layers.{i}.post_attention_layernorm.weight"),
            q=get(a + "q_proj.weight"), k=get(a + "k_proj.weight"), v=get(a + "v_proj.weight"),
            o=get(a + "o_proj.weight"), q_bias=get(a + "q_proj.bias", False), k_bias=get(a + "k_proj.bias", False),
            v_bias=get(a + "v_proj.bias", False), o_bias=get(a + "o_proj.bias", False),
            q_norm=get(a + "q_norm.weight", False), k_norm=get(a + "k_norm.weight", False),
            gate=get(f + "gate_proj.weight"), up=get(f + "up_proj.weight"), down=get(f + "down_proj.weight")))
    embed = get("embed_tokens.weight")
    lm_head = get("lm_head.weight", required=False)
    weights = ModelWeights(embed=embed, layers=layers, norm=get("norm.weight"),
                           lm_head=embed if lm_head is None else lm_head, owned_buffers=True)
    weights.ptrs = tuple(t.data_ptr() for t in weights.tensors())
    return weights


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
        # DTensor keeps its shard as `_local_tensor`, which `to_local()` returns through an autograd function
        # (~4 µs a parameter: ~2 ms of every LoRA switch at 0.5B, ~500 parameters); read it directly when present.
        local = getattr(p, "_local_tensor", None)
        return (to_local() if local is None else local).detach(), False
    return p.detach().to(dtype).full_tensor(), True


def _span(t: torch.Tensor) -> int:
    """Elements of storage from a matrix view's first element to its last, inclusive."""
    return sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1


def _regular_runs(items: list[tuple[torch.Tensor, ...]]) -> list[list[tuple[torch.Tensor, ...]]]:
    """Split items whose first entry is a matrix view (same storage, shape and strides; sorted by storage offset)
    into maximal runs at a constant offset step that does not overlap: each run is one strided batch."""
    span = _span(items[0][0])
    runs, run = [], [items[0]]
    for item in items[1:]:
        step = item[0].storage_offset() - run[-1][0].storage_offset()
        if step >= span and (len(run) == 1 or step == run[1][0].storage_offset() - run[0][0].storage_offset()):
            run.append(item)
        else:
            runs.append(run)
            run = [item]
    runs.append(run)
    return runs


def _batched_view(bufs: list[torch.Tensor]) -> torch.Tensor:
    """The [n, out, in] view of n equal-stride matrix views of one storage (`_regular_runs`); one matrix: itself."""
    if len(bufs) == 1:
        return bufs[0]
    first = bufs[0]
    step = bufs[1].storage_offset() - first.storage_offset()
    return first.as_strided((len(bufs), *first.shape), (step, *first.stride()), first.storage_offset())


class WeightView:
    """Builds and refreshes a `ModelWeights` over a module's parameters in the generation dtype."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        self.module, self.dtype, self.device = module, dtype, device
        self._buffers: dict[object, torch.Tensor] = {}  # id(param) or ("fused", id) -> reused generation buffer
        self._gathered: set[object] = set()  # keys whose buffer holds a full (multi-rank) tensor
        self._unsharded = False  # inside `_fsdp_unsharded`: parameters are FSDP's temporary full tensors
        self._parts: dict[object, list[torch.Tensor]] = {}  # (fused buffer key, layer) -> its row-slice views
        self._pending: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # copies batched into one foreach
        self._deltas: list[tuple[torch.Tensor, Factors, str]] = []  # (buffer holding W, (B, A, s), role): += s·B·A
        self._plus_one: list[torch.Tensor] = []  # fp32 copies of Gemma norm weights w, made 1 + w at the flush
        self._lora_layers = [m for m in module.modules() if hasattr(m, "lora_A")]  # PEFT LoRA layers
        # -> their base Linear (read directly: PEFT's `weight` property walks the wrapper chain)
        self._lora_base = {id(m): m.get_base_layer() for m in self._lora_layers}
        self._fsdp_modules = [m for m in module.modules() if _is_fsdp(m)]
        self._slot: tuple[int, int] | None = None  # (index, count) of the decoder layer being read, in `_layer`
        self._stacked: set[object] = set()  # stacks that handed out a slice in this build (not reallocated mid-build)
        self._rec: Recorder | None = None  # the slow build being recorded
        self._plan: BuildPlan | None = None  # the last slow build, replayed by `build` while it is valid

    def _factors(self, owner: nn.Module | None, attr: str) -> Factors | None:
        """(B, A, scale) when `owner.<attr>` is the weight of a PEFT LoRA layer with its adapter active, else None."""
        if attr != "weight" or owner is None or id(owner) not in self._lora_base:
            return None
        from hybridflow.engine.lora import lora_factors

        return lora_factors(owner)

    def _read(self, p: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """`_source(p)` (unsharded tensors count as temporary), noted by the recorder."""
        src, temporary = _source(p, self.dtype)
        temporary = temporary or self._unsharded
        self._rec.add(p, src, temporary)
        return src, temporary

    def _param(self, owner: nn.Module | None, attr: str) -> torch.Tensor | None:
        if owner is None:
            return None
        return getattr(self._lora_base.get(id(owner), owner), attr, None)

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
            self._rec.run((COPY, dst, src), self.dtype, self.device)
        if self._plus_one:
            self._rec.run((ADD_ONE, self._plus_one), self.dtype, self.device)
        self._pending, self._plus_one = ([], []), []
        self._apply_deltas()

    def _apply_deltas(self) -> None:
        """W += scale·B·A for every pending LoRA delta, in place and batched: the copies of one projection in every
        layer are equal-stride slices of one stack (`_buffer`), so one `baddbmm_` on a strided view of that stack
        merges them all — no stacked copy of the weights and no copy back (a row slice of a fused q/k/v or gate/up
        stack is a valid strided-batched GEMM output as is: rows contiguous, batch stride = one layer's fused matrix).
        The factors of all projections are cast and stacked by one `_foreach_copy_`; those temporaries are bounded by
        STACK_BYTES. One rounding per element, as `addmm_`: the GEMM accumulates in fp32 and adds W in its epilogue."""
        groups: dict[tuple, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        for buf, (b, a, scale), role in self._deltas:
            b, a = self._read(b)[0], self._read(a)[0]
            key = (role, buf.untyped_storage().data_ptr(), tuple(buf.shape), buf.stride(), tuple(b.shape),
                   tuple(a.shape), scale)
            groups.setdefault(key, []).append((buf, b, a))
        self._deltas = []
        chunks: list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], float]] = []
        for key, items in groups.items():
            scale = key[-1]
            items.sort(key=lambda item: item[0].storage_offset())
            per_item = (math.prod(items[0][1].shape) + math.prod(items[0][2].shape)) * self.dtype.itemsize
            per_chunk = max(1, STACK_BYTES // per_item)  # bounded temporaries
            for run in _regular_runs(items):
                for i in range(0, len(run), per_chunk):
                    part = run[i: i + per_chunk]
                    chunks.append((_batched_view([buf for buf, _, _ in part]), [b for _, b, _ in part],
                                   [a for _, _, a in part], scale))
        self._merge(chunks)

    def _merge(self, chunks: list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], float]]) -> None:
        """`w.baddbmm_(stack(bs), stack(as), alpha=scale)` for each (w [n, out, in], bs, as, scale); the factor
        stacks of consecutive chunks are filled by one `_foreach_copy_` (cast included) up to STACK_BYTES at a time.
        A chunk of one matrix (w is then that matrix) is an `addmm_` with no stacks."""
        sources: list[torch.Tensor] = []
        group: list[tuple[torch.Tensor, tuple[int, ...], tuple[int, ...], float]] = []
        held = 0
        for w, bs, as_, scale in chunks:
            if len(bs) == 1:
                self._rec.run((ADDMM, w, bs[0], as_[0], scale), self.dtype, self.device)
                continue
            size = (math.prod(bs[0].shape) + math.prod(as_[0].shape)) * len(bs) * self.dtype.itemsize
            if held and held + size > STACK_BYTES:
                self._rec.run((STACKED, sources, group), self.dtype, self.device)
                sources, group, held = [], [], 0
            sources += [*bs, *as_]
            group.append((w, (len(bs), *bs[0].shape), (len(as_), *as_[0].shape), scale))
            held += size
        if group:
            self._rec.run((STACKED, sources, group), self.dtype, self.device)

    def _buffer(self, key: object, shape: torch.Size, gathered: bool, slot: tuple[int, int] | None = None,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        """The reused buffer of `key`. With `slot` = (i, layers) (a decoder layer's role) it is slice i of one
        persistent [layers, *shape] stack, so that one projection's copies in every layer are equal-stride slices of
        one tensor (the batched in-place LoRA merge); a shape change reallocates the stack at its first use in a
        build; a layer whose shape differs from an earlier one's in the same build gets a buffer of its own.
        `dtype`: the buffer's, when not the generation dtype."""
        dtype = dtype or self.dtype
        if slot is not None:
            i, count = slot
            stack = self._buffers.get(key)
            if stack is None or stack.shape[0] != count or stack.shape[1:] != shape or stack.dtype != dtype:
                if key in self._stacked:  # an earlier layer of this build holds a slice of it
                    return self._buffer_unstacked((key, i), shape, gathered, dtype)
                stack = torch.empty((count, *shape), dtype=dtype, device=self.device)
                self._buffers[key] = stack
            self._stacked.add(key)
            if gathered:
                self._gathered.add(key)
            return stack[i]
        return self._buffer_unstacked(key, shape, gathered, dtype)

    def _buffer_unstacked(self, key: object, shape: torch.Size, gathered: bool, dtype: torch.dtype
                          ) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            self._buffers[key] = buf
        if gathered:
            self._gathered.add(key)
        return buf

    def _get(self, owner: nn.Module | None, attr: str = "weight", role: str = "", *, plus_one: bool = False
             ) -> torch.Tensor | None:
        """`owner.<attr>` in the generation dtype: the parameter itself when possible, else a reused buffer keyed by
        (role, attr) inside a decoder layer (a slice of that role's stack), (owner, attr) outside — stable across
        steps, unlike FSDP's temporary unsharded tensors. `plus_one` (Gemma's norms): 1 + w in an fp32 buffer."""
        p = self._param(owner, attr)
        if p is None:
            return None
        src, temporary = self._read(p)
        factors = self._factors(owner, attr)
        if not (temporary or plus_one) and factors is None and src.dtype == self.dtype and src.device == self.device:
            return src  # zero copy: the training parameter itself
        slot = self._slot if role else None
        buf = self._buffer(("layers", role, attr) if slot else (id(owner), attr), src.shape, temporary, slot,
                           torch.float32 if plus_one else None)
        if plus_one:
            self._plus_one.append(buf)
        if temporary and not self._unsharded:
            buf.copy_(src)  # a parameter gathered on its own is copied and freed at once
        else:
            self._copy(buf, src)
        if factors is not None:
            self._deltas.append((buf, factors, role))
        return buf

    def _get_fused(self, owners: list[nn.Module], roles: list[str], attr: str = "weight"
                   ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """(fused buffer, row-slice views) when every part needs a copy anyway; else (None, plain `_get`s)."""
        params = [self._param(o, attr) for o in owners]
        factors = [self._factors(o, attr) for o in owners]
        if any(p is None for p in params) or (all(f is None for f in factors) and any(map(self._zero_copy, params))):
            return None, [self._get(o, attr, role) for o, role in zip(owners, roles)]
        rows = [p.shape[0] for p in params]
        slot = self._slot if all(roles) else None
        key = ("layers", "+".join(roles), attr) if slot else ("fused", id(owners[0]), attr)
        buf = self._buffer(key, torch.Size([sum(rows), *params[0].shape[1:]]),
                           gathered=not all(self._zero_copy_shape(p) for p in params), slot=slot)
        parts_key = (key, slot[0] if slot else None)
        parts = self._parts.get(parts_key)
        if parts is None or parts[0].data_ptr() != buf.data_ptr():
            parts = self._parts[parts_key] = list(buf.split(rows, dim=0))
        for p, part, lora, role in zip(params, parts, factors, roles):
            src, temporary = self._read(p)
            if temporary and not self._unsharded:
                part.copy_(src)
            else:
                self._copy(part, src)
            if lora is not None:
                self._deltas.append((part, lora, role))
        return buf, parts

    def _zero_copy_shape(self, p: torch.Tensor) -> bool:
        """True when the parameter is whole on this rank (not a shard that had to be gathered)."""
        return not self._unsharded and (not hasattr(p, "to_local") or p.device_mesh.size() == 1)

    def _layer(self, layer: nn.Module) -> LayerWeights:
        att, mlp = layer.self_attn, layer.mlp
        if hasattr(att, "qkv_proj"):  # fused in the module (Phi-3): q/k/v are row views of it, no bias
            qkv, qkv_bias, (qb, kb, vb) = self._get(att.qkv_proj, role="qkv"), None, (None, None, None)
            cfg = self.module.config
            head_dim = arch_spec(self.module).head_dim
            q, k, v = qkv.split([cfg.num_attention_heads * head_dim, *[cfg.num_key_value_heads * head_dim] * 2])
        else:
            qkv_owners, qkv_roles = [att.q_proj, att.k_proj, att.v_proj], ["q", "k", "v"]
            qkv, (q, k, v) = self._get_fused(qkv_owners, qkv_roles)
            if qkv is not None and all(o.bias is not None for o in qkv_owners):
                qkv_bias, (qb, kb, vb) = self._get_fused(qkv_owners, qkv_roles, "bias")
            else:
                qkv_bias, (qb, kb, vb) = None, [self._get(o, "bias", r) for o, r in zip(qkv_owners, qkv_roles)]
        if moe_ops.is_moe_layer(mlp):
            lora = [n for n, m in mlp.named_modules() if hasattr(m, "lora_A") and not n.startswith("shared_expert")]
            gate_up, gate, up, down = None, None, None, None
            moe = moe_ops.build_weights(self._get, mlp, self.module.config, lora)
        else:
            if hasattr(mlp, "gate_up_proj"):  # fused in the module (Phi-3)
                gate_up = self._get(mlp.gate_up_proj, role="gate_up")
                gate, up = gate_up.chunk(2)
            else:
                gate_up, (gate, up) = self._get_fused([mlp.gate_proj, mlp.up_proj], ["gate", "up"])
            down, moe = self._get(mlp.down_proj, role="down"), None
        gemma = self.module.config.model_type in GEMMA_TYPES
        norm = functools.partial(self._get, plus_one=gemma)
        if gemma:  # post_attention_layernorm normalises the attention output; pre_feedforward_layernorm is ln2
            ln2, post_attn = norm(layer.pre_feedforward_layernorm, role="ln2"), norm(layer.post_attention_layernorm,
                                                                                    role="post_attn_norm")
            post_mlp = norm(layer.post_feedforward_layernorm, role="post_mlp_norm")
        else:
            ln2, post_attn, post_mlp = self._get(layer.post_attention_layernorm, role="ln2"), None, None
        return LayerWeights(
            ln1=norm(layer.input_layernorm, role="ln1"), ln2=ln2, post_attn_norm=post_attn, post_mlp_norm=post_mlp,
            q=q, k=k, v=v, o=self._get(att.o_proj, role="o"), q_bias=qb, k_bias=kb, v_bias=vb,
            o_bias=self._get(att.o_proj, "bias", "o"), q_norm=norm(getattr(att, "q_norm", None), role="q_norm"),
            k_norm=norm(getattr(att, "k_norm", None), role="k_norm"), gate=gate, up=up,
            down=down, qkv=qkv, qkv_bias=qkv_bias, gate_up=gate_up, moe=moe, gelu_tanh=gemma)

    def build(self) -> ModelWeights:
        """Refresh all views (cheap when zero-copy) and return them; `ptrs` tells callers if storage moved. Replays
        the recorded plan of the last slow build when it is still valid (`build_plan.py`: the same parameter
        objects, storage, shapes and dtypes, and LoRA flags): the same ops on the same buffers, returning the same
        `ModelWeights`, without walking the model; else walks it again (`_build_slow`) and records a new plan."""
        for fsdp_module in self._fsdp_modules:  # unsharded leftovers of a forward: we read (or gather) the shards
            fsdp_module.reshard()
        if self._plan is not None:
            weights = self._plan.replay(self.dtype, self.device)
            if weights is not None:
                return weights
            self._plan = None
        return self._build_slow()

    def _build_slow(self) -> ModelWeights:
        """Walk the model, copy / merge into the buffers, and record the plan (one rank only: on N ranks the
        sources are gathered temporaries, so every build takes this path)."""
        m = self.module
        inner = text_parts(m)[0]
        tied = m.lm_head.weight is inner.embed_tokens.weight
        layers = []
        self._stacked.clear()
        self._rec = Recorder(m)
        try:
            for i, layer in enumerate(inner.layers):
                with self._fsdp_unsharded(layer):
                    self._slot = (i, len(inner.layers))
                    try:
                        layers.append(self._layer(layer))
                    finally:
                        self._slot = None
            with self._fsdp_unsharded(m):
                embed = self._get(inner.embed_tokens)
                lm_head = embed if tied else self._get(m.lm_head)  # tied: one gather/cast, not two
                norm = self._get(inner.norm, plus_one=m.config.model_type in GEMMA_TYPES)
            self._flush()
            weights = ModelWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head,
                                   owned_buffers=bool(self._buffers))
            weights.ptrs = tuple(t.data_ptr() for t in weights.tensors())
            if tied:  # either replaced later → untied → the plan is stale
                self._rec.depend(inner.embed_tokens, "weight")
                self._rec.depend(m.lm_head, "weight")
            self._plan = self._rec.plan(weights, self._lora_layers)
        finally:
            self._rec = None
        return weights

    def release(self) -> None:
        """Drop the gathered full-weight buffers (N ranks; with their cached row views, which would keep them
        alive); keep one-rank dtype-cast buffers, which are smaller than the fp32 master weights they mirror and make
        the next switch a plain copy with no allocation."""
        self._plan = None  # holds the parameters (zero-copy views) and the buffers' views
        for key in self._gathered:
            self._buffers.pop(key, None)
        self._parts = {k: v for k, v in self._parts.items() if k[0] not in self._gathered}
        self._gathered.clear()
