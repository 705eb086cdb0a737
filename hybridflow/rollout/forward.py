"""Llama-family forward (Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma-3) over `ModelWeights`: batched prefill and one
decode step. Gemma-3's differences ride on the weights and spec: (1 + w) norms kept in fp32 (`rms_norm`), norms of
the attention and MLP outputs, GELU-tanh, a scaled embedding and attention, and RoPE tables per layer type.

Numerics follow the HF modules op for op (fp32 RMSNorm statistics, RoPE in the activation dtype, SDPA), so greedy
decoding matches `generate` token for token in fp32. Decode folds the GQA group into SDPA's query axis
(q [b, Hkv, G, D] against the cache's [b, Hkv, T, D]) so the KV cache is read once, never expanded.
The pure per-layer pieces (`qkv`, `mlp_block`) are separate so the GPU path can `torch.compile` them for fusion
while cache writes and attention stay eager (no compiled mutation of the cache); on CUDA with Triton both are our
kernels (one launch writes a layer's K and V for all rows, one attends over each row's column range). Decode and
`extend_ranged` cut the layer after the next input norm instead (`mlp_block_norm` → `qkv_normed`), so the
residual add ending one layer and the RMSNorm starting the next compile into one kernel.

Legend: B prompts, P prompt length, b decode rows, T cache length, H heads, Hkv kv heads, G = H / Hkv, D head dim.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from hybridflow.rollout.fp8 import linear
from hybridflow.rollout.kv_cache import KVCache
from hybridflow.rollout.moe import moe_mlp
from hybridflow.rollout.vision import mrope_components
from hybridflow.rollout.weights import ArchSpec, LayerWeights, ModelWeights, text_parts
from hybridflow.utils import triton_util
from hybridflow.utils.compile import GuardedCompile

logger = logging.getLogger(__name__)
_EXTEND_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # not cuDNN: see `extend_batch`


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: w times the normalised x rounded to x's dtype. A weight kept in fp32 under a lower-precision
    x (Gemma's 1 + w, `WeightView`) multiplies before the rounding, as Gemma's norm does (in fp32: the same product)."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if w.dtype == torch.float32 and dtype != torch.float32:
        return (xf * w).to(dtype)
    return w * xf.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def qkv(x: torch.Tensor, lw: LayerWeights, cos: torch.Tensor, sin: torch.Tensor, heads: tuple[int, int, int],
        eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., hidden] (pre-norm residual) → q [..., H, D], k, v [..., Hkv, D] with RoPE applied."""
    return qkv_normed(rms_norm(x, lw.ln1, eps), lw, cos, sin, heads, eps)


def qkv_normed(xn: torch.Tensor, lw: LayerWeights, cos: torch.Tensor, sin: torch.Tensor,
               heads: tuple[int, int, int], eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`qkv` after the input RMSNorm: xn [..., hidden] is rms_norm(x, lw.ln1) (the previous `mlp_block_norm`
    computed it, fused with its residual add)."""
    q, k, v = qkv_project(xn, lw, heads, eps)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in x's dtype (cos/sin broadcastable to x)."""
    return x * cos + _rotate_half(x) * sin


def qkv_project(xn: torch.Tensor, lw: LayerWeights, heads: tuple[int, int, int],
                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`qkv_normed` before RoPE: projections and the q/k norms (for kernels that apply RoPE themselves)."""
    h, hkv, d = heads
    if lw.qkv is not None and (lw.qkv_bias is not None or lw.q_bias is None):
        q, k, v = linear(xn, lw.qkv, lw.qkv_bias, lw.qkv_scale).split([h * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.unflatten(-1, (h, d)), k.unflatten(-1, (hkv, d)), v.unflatten(-1, (hkv, d))
    else:
        q = F.linear(xn, lw.q, lw.q_bias).unflatten(-1, (h, d))
        k = F.linear(xn, lw.k, lw.k_bias).unflatten(-1, (hkv, d))
        v = F.linear(xn, lw.v, lw.v_bias).unflatten(-1, (hkv, d))
    if lw.q_norm is not None:
        q, k = rms_norm(q, lw.q_norm, eps), rms_norm(k, lw.k_norm, eps)
    return q, k, v


def mlp_block(x: torch.Tensor, attn: torch.Tensor, lw: LayerWeights, eps: float) -> torch.Tensor:
    """Residual stream after o_proj and the SwiGLU (Gemma: GELU-tanh) MLP; attn [..., H*D]."""
    h = linear(attn, lw.o, lw.o_bias, lw.o_scale)
    x = residual_add(x, h if lw.post_attn_norm is None else rms_norm(h, lw.post_attn_norm, eps))
    xn = rms_norm(x, lw.ln2, eps)
    if lw.moe is not None:
        return residual_add(x, moe_mlp(xn, lw.moe))
    if lw.gate_up is not None:
        gate, up = linear(xn, lw.gate_up, scale=lw.gate_up_scale).chunk(2, dim=-1)
    else:
        gate, up = F.linear(xn, lw.gate), F.linear(xn, lw.up)
    act = F.gelu(gate, approximate="tanh") if lw.gelu_tanh else F.silu(gate)
    h = linear(act * up, lw.down, scale=lw.down_scale)
    return residual_add(x, h if lw.post_mlp_norm is None else rms_norm(h, lw.post_mlp_norm, eps))


def residual_add(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """x + h. Under torch.compile written as an fp32 sum rounded once to x's dtype — the same bits as torch's
    bf16/fp16 `x + h` — so that Inductor does not fold the add into the projection as cuBLAS addmm, which first
    copies x into the output (two extra kernels per layer; the add fuses with the next norm instead). Eager: the
    plain add (one kernel instead of four)."""
    if not torch.compiler.is_compiling():
        return x + h
    return (x.float() + h.float()).to(x.dtype)


def mlp_block_norm(x: torch.Tensor, attn: torch.Tensor, lw: LayerWeights, next_norm: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`mlp_block`, then the next RMSNorm of the new residual (the next layer's ln1, or the final norm after the
    last layer): (x, rms_norm(x, next_norm)). One compiled function, so the MLP's residual add and the norm that
    reads it fuse into one kernel; the same ops in the same order as `mlp_block` followed by `rms_norm`."""
    x = mlp_block(x, attn, lw, eps)
    return x, rms_norm(x, next_norm, eps)


def embed_norm(tok: torch.Tensor, embed: torch.Tensor, ln1: torch.Tensor, eps: float,
               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's start and the first layer's input norm: (x, rms_norm(x, ln1)), x = embed[tok]
    (times `scale`, Gemma's)."""
    x = scaled(F.embedding(tok, embed), scale)
    return x, rms_norm(x, ln1, eps)


def scaled(x: torch.Tensor, scale: float | None) -> torch.Tensor:
    """x * scale (the spec's `embed_scale`, already rounded to x's dtype); x itself when None."""
    return x if scale is None else x * scale


def sdpa_attention(q_bHGD: torch.Tensor, k_bHTD: torch.Tensor, v_bHTD: torch.Tensor,
                   mask_b11T: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """GQA decode attention through SDPA: the G query heads of a kv head ride on SDPA's query axis."""
    return F.scaled_dot_product_attention(q_bHGD, k_bHTD, v_bHTD, attn_mask=mask_b11T, scale=scale)


Heads = tuple[int, int, int]  # (H, Hkv, D)
QKVFn = Callable[[torch.Tensor, LayerWeights, torch.Tensor, torch.Tensor, Heads, float],
                 tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # `qkv`, `qkv_normed`
QKVProjectFn = Callable[[torch.Tensor, LayerWeights, Heads, float], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
MLPFn = Callable[[torch.Tensor, torch.Tensor, LayerWeights, float], torch.Tensor]  # `mlp_block`
MLPNormFn = Callable[[torch.Tensor, torch.Tensor, LayerWeights, torch.Tensor, float],
                     tuple[torch.Tensor, torch.Tensor]]  # `mlp_block_norm`
EmbedNormFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, float | None],
                       tuple[torch.Tensor, torch.Tensor]]  # `embed_norm`
LinearFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # F.embedding(ids, table), F.linear(x, lm_head)


class RangeAttention(Protocol):
    """o [b, Hkv, G, D] attending each query row to cache row `rows[i]` (default i), columns [start[i], end[i]);
    with cos/sin [b, D] RoPE is applied to q first (`decode_attention.decode_attention`, its `_ref`); `scale` of
    q·k defaults to 1/sqrt(D)."""

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor,
                 end: torch.Tensor, *, scale: float | None = None, rows: torch.Tensor | None = None,
                 cos: torch.Tensor | None = None,
                 sin: torch.Tensor | None = None) -> torch.Tensor:
        ...


class KVStore(Protocol):
    """k_cache[rows[i], :, cidx[i]] = k[i] (RoPE applied with cos/sin), v likewise (`kv_store_kernel.store_kv`)."""

    def __call__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cidx: torch.Tensor, rows: torch.Tensor | None = None, *, cos: torch.Tensor | None = None,
                 sin: torch.Tensor | None = None) -> None:
        ...


@dataclass(frozen=True)
class DecodeOps:
    """The pure pieces of a decode step, chosen once per engine (`for_device`); eager by default,
    `torch.compile`d on GPU when asked (fuses the norms, RoPE and SwiGLU). `attention` is None for SDPA over the
    additive mask, or a kernel taking each row's contiguous valid column range. `kv_store` is None for two
    `index_put`s per layer, or a kernel writing both in one launch. The sampler is chosen beside these
    (`sampling.build_sampler`)."""

    qkv: QKVFn = qkv
    mlp_block: MLPFn = mlp_block
    attention: RangeAttention | None = None
    kv_store: KVStore | None = None
    is_compiled: bool = False
    # The fused-norm composition (`fuse_norms`, the default): each layer is `qkv_normed` and `mlp_block_norm`,
    # which also returns the next layer's normed input, so a layer's last residual add and the next input RMSNorm
    # are one compiled function (one kernel) instead of the tail of one and the head of the next; `embed_norm`
    # starts the stream. False: `qkv` and `mlp_block` as before (kept for comparison and for any caller).
    qkv_normed: QKVFn = qkv_normed
    mlp_block_norm: MLPNormFn = mlp_block_norm
    embed_norm: EmbedNormFn = embed_norm
    fuse_norms: bool = True
    # Decode applies RoPE inside the K/V-store kernel (to k) and the attention kernel (to q), given each row's
    # cos/sin, so `qkv_project` replaces `qkv_normed` and the RoPE kernels go (fp32, one rounding: on an H200 the
    # same bits as the compiled torch RoPE, 7% faster decode steps at 0.5B). Only with `fuse_norms` and both
    # `kv_store` and `attention` set (their torch references take cos/sin too), i.e. our CUDA kernels.
    qkv_project: QKVProjectFn = qkv_project
    rope_in_kernels: bool = True
    # The token embedding and the LM head; tensor parallelism (`tensor_parallel.TPContext.decode_ops`) replaces
    # them, `mlp_block*` and `embed_norm` with pieces that all-reduce over the group.
    embed: LinearFn = F.embedding
    logits: LinearFn = F.linear

    @classmethod
    def compiled(cls) -> DecodeOps:
        """One process-wide compiled set. Shapes are specialised at the first call and only the dimensions that
        change later (the batch bucket, an extension's token count) become dynamic — a few compiles a piece
        (the first shape, the dynamic one, a size-1 batch), far under Dynamo's recompile limit; every layer reuses
        the same code. Fully dynamic shapes (hidden sizes too) made the 0.5B/1.5B decode
        step 6-10% slower on an H200 (looped reductions and generic pointwise kernels)."""
        return _compiled_ops()

    @classmethod
    def for_device(cls, device: torch.device, compile_ops: bool) -> DecodeOps:
        """Compiled pieces when asked; on CUDA with Triton, our decode-attention and KV-write kernels."""
        ops = cls.compiled() if compile_ops else cls()
        attention = _triton_attention(device)
        if attention is None:
            return ops
        return dataclasses.replace(ops, attention=attention, kv_store=_triton_kv_store(device))


EAGER_OPS = DecodeOps()  # the eager torch pieces (prefill and the SDPA extension always run these)


@functools.lru_cache(maxsize=1)
def _compiled_ops() -> DecodeOps:
    def auto(fn: Callable, what: str) -> GuardedCompile:
        return GuardedCompile(fn, f"the rollout's {what}", dynamic=None)

    return DecodeOps(qkv=auto(qkv, "qkv"), mlp_block=auto(mlp_block, "mlp_block"),
                     qkv_normed=auto(qkv_normed, "qkv_normed"), mlp_block_norm=auto(mlp_block_norm, "mlp_block_norm"),
                     embed_norm=auto(embed_norm, "embed_norm"), qkv_project=auto(qkv_project, "qkv_project"),
                     is_compiled=True)


@functools.lru_cache(maxsize=1)
def compiled_prefill_ops() -> DecodeOps:
    """Prefill's `qkv` and `mlp_block`, compiled apart from decode's fused pieces (decode runs `qkv_normed` /
    `mlp_block_norm`: other code objects, so other compile caches) with their own failure flags: a prefill shape
    that fails to compile leaves decode compiled. Specialised
    to the first prompt batch's shape, then dynamic in the batch and prompt length."""
    return DecodeOps(qkv=GuardedCompile(qkv, "the rollout's prefill qkv", dynamic=None),
                     mlp_block=GuardedCompile(mlp_block, "the rollout's prefill mlp_block", dynamic=None),
                     is_compiled=True)


def _triton_attention(device: torch.device) -> RangeAttention | None:
    """The decode-attention Triton kernel for `device`, or None to stay with SDPA."""
    if device.type != "cuda":
        return None
    try:
        from hybridflow.rollout import decode_attention
    except ImportError as err:  # triton missing: SDPA it is
        logger.info("rollout: Triton kernels unavailable (%s); using SDPA", err)
        return None
    if not decode_attention.triton_available(device):
        return None
    return decode_attention.decode_attention


def _triton_kv_store(device: torch.device) -> KVStore | None:
    """The one-launch K/V cache write for `device` (CUDA with Triton), or None for torch `index_put`."""
    if device.type != "cuda":
        return None
    from hybridflow.rollout import kv_store_kernel

    return kv_store_kernel.store_kv if triton_util.triton_available(device) else None


class RopeTable:
    """cos/sin for positions [0, max_len) from the module's own rotary embedding (handles every rope_type); one
    table per layer type when the embedding takes the type (Gemma-3: local and global RoPE bases). Qwen2.5-VL's
    multimodal RoPE: positions [..., 3] (t, h, w) read each rotary dim at its component's position (`vision.py`)."""

    def __init__(self, module: nn.Module, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        inner, cfg = text_parts(module)
        rotary = inner.rotary_emb
        pos = torch.arange(max_len, device=device)[None]
        if getattr(rotary, "mrope_section", None):  # transformers 5.17's multimodal rope takes [3, B, L] positions only
            pos = pos.expand(3, 1, max_len)
        dummy = torch.zeros(1, dtype=dtype, device=device)
        types = list(getattr(rotary, "layer_types", None) or [None])
        self.tables = []  # [(cos, sin)] each [max_len, D]
        with torch.no_grad():
            for t in types:
                cos, sin = rotary(dummy, pos) if t is None else rotary(dummy, pos, t)
                self.tables.append((cos[0].to(dtype), sin[0].to(dtype)))
        self.cos, self.sin = self.tables[0]
        n = cfg.num_hidden_layers
        self.layer_table = [0] * n if types == [None] else [types.index(t) for t in cfg.layer_types[:n]]
        self.max_len = max_len
        comp = mrope_components(rotary, self.cos.shape[-1])
        self.mrope_D = None if comp is None else comp.to(device)

    def at(self, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer: (cos, sin) [*pos.shape, D] at positions `pos` (one gather per table); multimodal positions
        [B, P, 3] give [B, P, D]."""
        if pos.dim() == 3:
            assert self.mrope_D is not None, f"3-D positions {tuple(pos.shape)} for a model without mrope_section"
            idx = self.mrope_D.expand(*pos.shape[:2], 1, -1)
            got = [(cos[pos].gather(-2, idx).squeeze(-2), sin[pos].gather(-2, idx).squeeze(-2))
                   for cos, sin in self.tables]
        else:
            got = [(cos[pos], sin[pos]) for cos, sin in self.tables]
        return [got[i] for i in self.layer_table]


def prefill(w: ModelWeights, spec: ArchSpec, rope: RopeTable, ids_BP: torch.Tensor, mask_BP: torch.Tensor,
            pos_BP: torch.Tensor, cache: KVCache, slots_M: torch.Tensor, src_M: torch.Tensor,
            ops: DecodeOps = EAGER_OPS, embeds_BPH: torch.Tensor | None = None) -> torch.Tensor:
    """Run left-padded prompts, copy prompt b's K/V into cache slots where src == b; return last logits [B, V].
    Of `ops` only `embed`, `qkv`, `mlp_block` and `logits` are used: eager ones, the tensor-parallel pieces, or
    `compiled_prefill_ops()` (norms, RoPE and SwiGLU fused; the GEMMs are the same). Vision-language prompts:
    `embeds_BPH` replaces the token embeddings (image embeddings at the image pads) and `pos_BP` is [B, P, 3]."""
    B, P = ids_BP.shape
    heads = (spec.num_heads, spec.num_kv_heads, spec.head_dim)
    group = spec.num_heads // spec.num_kv_heads
    x = scaled(ops.embed(ids_BP, w.embed), spec.embed_scale) if embeds_BPH is None else embeds_BPH
    rope_L = rope.at(pos_BP)
    causal = torch.ones(P, P, dtype=torch.bool, device=ids_BP.device).tril()
    # Pad query rows see only themselves (no NaN from all-masked rows); real rows see real keys up to themselves.
    attn_mask = (causal & mask_BP.bool()[:, None, :]) | torch.eye(P, dtype=torch.bool, device=ids_BP.device)
    attn_mask = attn_mask[:, None]
    # Unpadded prompts need no mask: a causal SDPA takes the flash kernel, which also reads the K/V heads ungrouped
    # (`enable_gqa`) instead of repeated `group` times (two copies of the prompt's K/V a layer). With a padding mask
    # the K/V stay repeated: the memory-efficient kernel that takes a mask has no GQA form (SDPA would fall back to
    # its math path, [B, H, P, P] fp32 scores).
    causal_only = bool(mask_BP.all())
    gqa = causal_only and ids_BP.device.type == "cuda" and group > 1
    for layer, lw in enumerate(w.layers):
        q, k, v = ops.qkv(x, lw, *rope_L[layer], heads, spec.eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, P, D]
        cache.write_prompt(layer, k, v, slots_M, src_M)
        if not gqa:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if causal_only else attn_mask,
                                           is_causal=causal_only, enable_gqa=gqa, scale=spec.attn_scale)
        x = ops.mlp_block(x, o.transpose(1, 2).flatten(-2), lw, spec.eps)
    last = rms_norm(x[:, -1], w.norm, spec.eps)
    return ops.logits(last, w.lm_head)


def decode(w: ModelWeights, spec: ArchSpec, rope: RopeTable, ops: DecodeOps, tok_b: torch.Tensor,
           pos_b: torch.Tensor, cidx_b: torch.Tensor, valid_bT: torch.Tensor, start_b: torch.Tensor, cache: KVCache,
           kv_len: int) -> torch.Tensor:
    """One token per row: write its K/V at column cidx, attend over the row's valid columns among the first
    `kv_len` (the caller guarantees cidx < kv_len for live rows); logits [b, V]. A row's valid columns are the
    contiguous range [start, cidx] (left-padded prompt, then its tokens): `ops.attention` kernels use that range,
    SDPA uses the `valid` mask.

    Mutates `valid_bT` (marks cidx) and the cache; shapes are static so the call can be captured in a CUDA graph.
    """
    b = tok_b.shape[0]
    heads = (spec.num_heads, spec.num_kv_heads, spec.head_dim)
    rows = torch.arange(b, device=tok_b.device) if ops.kv_store is None else None
    valid_bT.scatter_(1, cidx_b[:, None], True)
    fuse = ops.fuse_norms
    if fuse:
        x, xn = ops.embed_norm(tok_b, w.embed, w.layers[0].ln1, spec.eps, spec.embed_scale)
    else:
        x = scaled(ops.embed(tok_b, w.embed), spec.embed_scale)
    if ops.attention is None:  # additive mask built once per step (not converted from bool inside every layer)
        valid = valid_bT[:, :kv_len]
        attn_mask = torch.zeros(valid.shape, dtype=x.dtype, device=x.device).masked_fill_(~valid, float("-inf"))
        attn_mask = attn_mask[:, None, None, :]
    else:
        end_b = cidx_b + 1
    rope_L = rope.at(pos_b)
    rope_k = ops.rope_in_kernels and fuse and ops.kv_store is not None and ops.attention is not None
    for layer, lw in enumerate(w.layers):
        cos, sin = rope_L[layer]
        kernel_rope = dict(cos=cos, sin=sin) if rope_k else {}
        if rope_k:
            q, k, v = ops.qkv_project(xn, lw, heads, spec.eps)
        elif fuse:
            q, k, v = ops.qkv_normed(xn, lw, cos, sin, heads, spec.eps)
        else:
            q, k, v = ops.qkv(x, lw, cos, sin, heads, spec.eps)
        kc, vc = cache.k[layer], cache.v[layer]
        if ops.kv_store is None:
            kc[rows, :, cidx_b] = k
            vc[rows, :, cidx_b] = v
        else:
            ops.kv_store(kc, vc, k, v, cidx_b, **kernel_rope)
        qg = q.view(b, spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim)
        if ops.attention is None:
            o = sdpa_attention(qg, kc[:b, :, :kv_len], vc[:b, :, :kv_len], attn_mask, spec.attn_scale)
        else:
            o = ops.attention(qg, kc, vc, start_b, end_b, scale=spec.attn_scale, **kernel_rope)
        if fuse:  # the next layer's input norm, or the final norm after the last layer
            nxt = w.layers[layer + 1].ln1 if layer + 1 < len(w.layers) else w.norm
            x, xn = ops.mlp_block_norm(x, o.reshape(b, -1), lw, nxt, spec.eps)
        else:
            x = ops.mlp_block(x, o.reshape(b, -1), lw, spec.eps)
    return ops.logits(xn if fuse else rms_norm(x, w.norm, spec.eps), w.lm_head)


def extend_ranged(w: ModelWeights, spec: ArchSpec, rope: RopeTable, ops: DecodeOps, ids_N: torch.Tensor,
                  pos_N: torch.Tensor, slot_N: torch.Tensor, col_N: torch.Tensor, start_N: torch.Tensor,
                  last_S: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Multi-turn extension as a flat batch of N new tokens through the decode path's pieces: token i belongs to
    cache slot `slot_N[i]`, is written at column `col_N[i]` and attends to that slot's columns
    [start_N[i], col_N[i]] — its slot's history and, causally, the extension's earlier tokens, whose K/V the same
    layer wrote first. Logits [S, V] of the tokens `last_S` (each slot's last new token).

    Every layer is the decode step's four launches-worth of work — `ops.qkv_normed` and `ops.mlp_block_norm`
    (compiled; the token count becomes a dynamic dimension after its first change: no recompile per call), one
    K/V store and one range-attention kernel (`ops.attention`, with a
    row map from query token to cache slot) — so a call costs ~4 × layers launches whatever its shape, where the
    SDPA path (`extend_batch`) spends ~40 per layer on masks, gathers and permutes. No host sync, no
    data-dependent shape: with fixed N and S it can be captured in a CUDA graph. Duplicate tokens (same slot,
    column, id and position) are allowed: they write identical K/V."""
    N = ids_N.shape[0]
    heads = (spec.num_heads, spec.num_kv_heads, spec.head_dim)
    hkv, group, d = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim
    store = ops.kv_store or _store_kv_torch
    end_N = col_N + 1
    fuse, n_layers = ops.fuse_norms, len(w.layers)
    if fuse:
        x, xn = ops.embed_norm(ids_N, w.embed, w.layers[0].ln1, spec.eps, spec.embed_scale)
    else:
        x = scaled(ops.embed(ids_N, w.embed), spec.embed_scale)
    rope_L = rope.at(pos_N)
    for layer, lw in enumerate(w.layers):
        cos, sin = rope_L[layer]
        q, k, v = ops.qkv_normed(xn, lw, cos, sin, heads, spec.eps) if fuse else ops.qkv(x, lw, cos, sin, heads, spec.eps)
        kc, vc = cache.k[layer], cache.v[layer]
        store(kc, vc, k, v, col_N, slot_N)
        o = ops.attention(q.view(N, hkv, group, d), kc, vc, start_N, end_N, scale=spec.attn_scale, rows=slot_N)
        if fuse and layer + 1 < n_layers:  # the last layer's final norm runs on the S returned rows only
            x, xn = ops.mlp_block_norm(x, o.reshape(N, -1), lw, w.layers[layer + 1].ln1, spec.eps)
        else:
            x = ops.mlp_block(x, o.reshape(N, -1), lw, spec.eps)
    return ops.logits(rms_norm(x[last_S], w.norm, spec.eps), w.lm_head)


def _store_kv_torch(kc: torch.Tensor, vc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, col_N: torch.Tensor,
                    slot_N: torch.Tensor) -> None:
    kc[slot_N, :, col_N] = k
    vc[slot_N, :, col_N] = v


def extend_batch(w: ModelWeights, spec: ArchSpec, rope: RopeTable, ids_SK: torch.Tensor, pos_SK: torch.Tensor,
                 lens: list[int], cache: KVCache, slots_S: torch.Tensor, col0: list[int],
                 valid_XT: torch.Tensor, ops: DecodeOps = EAGER_OPS) -> torch.Tensor:
    """Multi-turn extension of S slots in one forward: slot `slots_S[i]` appends the first `lens[i]` tokens of row i of
    `ids_SK` (right-padded) at cache columns [col0[i], col0[i] + lens[i]); each token attends to its slot's
    valid columns before col0 and causally to the new ones. Padding tokens write nothing and are not returned.
    Marks the new columns valid in `valid_XT` (all slots' rows); the last real token's logits [S, V].

    `lens` and `col0` are host lists, so every index below is built on the host and copied once: no step of the
    24-layer loop waits for the GPU (boolean-mask indexing would sync twice per layer). As in decode, the G query
    heads of a kv head ride on SDPA's query axis (q [S, Hkv, G*K, D] against [S, Hkv, end, D]: no K/V copies), and
    SDPA is held to the memory-efficient / math kernels: cuDNN's builds a plan per new shape (~0.6 ms of host time
    per layer on an H200) and every call here has a new (S, K, end). Eager for the same reason (a compiled graph
    would recompile); of `ops` only the tensor-parallel pieces are used, as in `prefill`."""
    S, K = ids_SK.shape
    dev = ids_SK.device
    heads = (spec.num_heads, spec.num_kv_heads, spec.head_dim)
    flat = [i * K + j for i, n in enumerate(lens) for j in range(n)]  # real tokens of ids_SK.flatten()
    host = torch.tensor([flat, [col0[i] + j for i, n in enumerate(lens) for j in range(n)],
                         [i for i, n in enumerate(lens) for _ in range(n)]], dtype=torch.long)
    end = max(c + n for c, n in zip(col0, lens))
    cols_SK = torch.tensor(col0, dtype=torch.long)[:, None] + torch.arange(K)[None]
    last_S = torch.tensor(lens, dtype=torch.long) - 1
    host, cols_SK, last_S = (t.to(dev, non_blocking=True) for t in (host, cols_SK, last_S))
    flat_t, c_idx, s_idx = host[0], host[1], slots_S[host[2]]
    valid_XT[s_idx, c_idx] = True
    c = torch.arange(end, device=dev)
    mask_SKC = valid_XT[slots_S, :end][:, None, :] & (c[None, None, :] <= cols_SK[:, :, None])
    hkv, group, d = spec.num_kv_heads, spec.num_heads // spec.num_kv_heads, spec.head_dim
    mask = mask_SKC[:, None, None].expand(S, 1, group, K, end).reshape(S, 1, group * K, end)  # once, all layers
    x = scaled(ops.embed(ids_SK, w.embed), spec.embed_scale)
    rope_L = rope.at(pos_SK)
    with sdpa_kernel(_EXTEND_BACKENDS):
        for layer, lw in enumerate(w.layers):
            q, k, v = qkv(x, lw, *rope_L[layer], heads, spec.eps)  # [S, K, heads, D]
            cache.k[layer][s_idx, :, c_idx] = k.flatten(0, 1).index_select(0, flat_t)
            cache.v[layer][s_idx, :, c_idx] = v.flatten(0, 1).index_select(0, flat_t)
            kc = cache.k[layer][slots_S, :, :end]  # [S, Hkv, end, D]
            vc = cache.v[layer][slots_S, :, :end]
            qg = q.view(S, K, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(S, hkv, group * K, d)
            o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=mask, scale=spec.attn_scale)  # [S, Hkv, G*K, D]
            o = o.view(S, hkv, group, K, d).permute(0, 3, 1, 2, 4).reshape(S, K, hkv * group * d)
            x = ops.mlp_block(x, o, lw, spec.eps)
    last = x[torch.arange(S, device=dev), last_S]
    return ops.logits(rms_norm(last, w.norm, spec.eps), w.lm_head)
