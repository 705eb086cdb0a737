"""Packed (padding-free) attention for HF models: one registered implementation, `hybridflow_packed`.

Decision: with `cu_seqlens` in the forward kwargs, each packed sequence attends causally to itself only —
via PyTorch's built-in varlen flash attention (`torch.nn.attention.varlen`, CUDA, bf16/fp16) or, elsewhere, one
SDPA call on the sequences scattered into a right-padded batch. Without `cu_seqlens` (padded batches) it is exactly HF's SDPA path with HF's mask, so
one model serves both layouts. No [T, T] mask is ever built for packed batches.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hybridflow.engine import invariant

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "hybridflow_packed"
# Forward kwargs carrying the packing (names of our own, so HF's flash-attention logic never sees them).
CU_SEQLENS, MAX_SEQLEN = "hf_cu_seqlens", "hf_max_seqlen"

try:  # torch >= 2.9
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn

    _VARLEN_PARAMS = set(inspect.signature(_varlen_attn).parameters)
except ImportError:  # pragma: no cover - depends on the torch build
    _varlen_attn = None
    _VARLEN_PARAMS = set()


# Set when the varlen kernel raised once (e.g. an unsupported GPU or API drift): later calls use SDPA.
_varlen_error: str | None = None


def varlen_supported(q: torch.Tensor) -> bool:
    return (_varlen_attn is not None and _varlen_error is None and q.is_cuda
            and q.dtype in (torch.float16, torch.bfloat16))


def packed_backend(device: torch.device, dtype: torch.dtype) -> str:
    """Which kernel packed attention uses for this device/dtype (for benchmark records and logs)."""
    probe = torch.empty(0, device=device, dtype=dtype)
    return "varlen_flash" if varlen_supported(probe) else "padded_sdpa"


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
            scale: float | None) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] → [T, Hq, D] through the flash varlen kernel (API differs across torch)."""
    kw: dict[str, Any] = {}
    if "window_size" in _VARLEN_PARAMS:
        kw["window_size"] = (-1, 0)  # causal
    else:
        kw["is_causal"] = True
    if "scale" in _VARLEN_PARAMS:
        kw["scale"] = scale
    elif scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise ValueError(f"this torch's varlen_attn has no `scale` argument; model scaling {scale} is not 1/sqrt(d)")
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in _VARLEN_PARAMS:
            kw["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    cu = cu.to(torch.int32)
    return _varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
                        scale: float | None, softcap: float | None, window: int | None) -> torch.Tensor:
    """q [B, Hq, Q, D], k/v [B, Hkv, K, D] → [B, Hq, Q, D] with the scores in the open, for what SDPA cannot do:
    Gemma-2's tanh soft-capping of the scores (HF's eager math). `allowed` is a bool mask broadcastable to
    [B, Hq, Q, K] or an additive float one; None = causal, limited to `window` keys back when given."""
    if q.shape[1] != k.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if allowed is None:
        qi = torch.arange(q.shape[2], device=q.device)[:, None] + (k.shape[2] - q.shape[2])
        ki = torch.arange(k.shape[2], device=q.device)[None]
        allowed = (ki <= qi) & ((qi - ki < window) if window else True)
    if allowed.dtype == torch.bool:
        s = s.masked_fill(~allowed, torch.finfo(s.dtype).min)
    else:
        s = s + allowed[..., : k.shape[2]]
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _padded_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                 scale: float | None, softcap: float | None = None, window: int | None = None) -> torch.Tensor:
    """q [1, Hq, T, D], k/v [1, Hkv, T, D] → [1, T, Hq, D]: the packed sequences scattered into one padded
    [N, H, L, D] batch, one causal SDPA call, gathered back (CPU / fp32 path).

    Right padding keeps causal attention exact for every real query (it only sees earlier, real keys). Scatter and
    gather keep backward O(T); slicing each sequence out of the packed row made backward O(N·T).
    """
    lens = cu[1:] - cu[:-1]
    n, total = int(lens.numel()), q.shape[2]
    max_len = int(lens.max()) if n else 0
    seq_id = torch.repeat_interleave(torch.arange(n, device=q.device), lens.to(q.device))
    pos = torch.arange(total, device=q.device) - cu[:-1].to(q.device)[seq_id]

    def pad(x: torch.Tensor) -> torch.Tensor:  # [1, H, T, D] → [N, H, L, D]
        out = x.new_zeros(n, max_len, x.shape[1], x.shape[3])
        out = out.index_put((seq_id, pos), x[0].transpose(0, 1))
        return out.transpose(1, 2)

    window = window if window and window < max_len else None
    if softcap or window:  # Gemma-2: soft-capped scores; sliding-window layers shorter than a sequence
        out = _explicit_attention(pad(q), pad(k), pad(v), None, scale, softcap, window)
    else:
        out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)[seq_id, pos].unsqueeze(0).contiguous()


def packed_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0,
                             scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """HF attention-interface function: varlen when `hf_cu_seqlens` is given, else HF SDPA."""
    cu = kwargs.pop(CU_SEQLENS, None)
    max_len = kwargs.pop(MAX_SEQLEN, None)
    exact = kwargs.pop(invariant.EXACT_KWARG, False)
    softcap, window = kwargs.get("softcap"), kwargs.get("sliding_window")
    if cu is None and softcap:  # SDPA refuses soft-capping; HF's mask already holds causality/window/padding
        if dropout:
            raise ValueError("soft-capped attention here does not support attention dropout; set attention_dropout=0")
        out = _explicit_attention(query, key, value, attention_mask, scaling, softcap, window)
        return out.transpose(1, 2).contiguous(), None
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed row, got batch {query.shape[0]}")
    if dropout:
        raise ValueError("packed attention does not support attention dropout; set attention_dropout=0")
    plain = functools.partial(_packed, cu=cu, max_len=int(max_len), scaling=scaling, softcap=softcap, window=window)
    if exact:  # batch-invariant forward values; backward differentiates the plain packed attention
        return invariant.packed_attention(query, key, value, cu, scaling, plain), None
    return plain(query, key, value), None


def _packed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, max_len: int,
            scaling: float | None, softcap: float | None, window: int | None) -> torch.Tensor:
    """Packed causal attention [1, T, H, D]: varlen flash attention where it runs, else padded SDPA."""
    if varlen_supported(query) and not softcap and not (window and window < max_len):
        try:
            out = _varlen(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu,
                          max_len, scaling)
            return out.unsqueeze(0)
        except (RuntimeError, TypeError, NotImplementedError) as e:
            global _varlen_error
            _varlen_error = f"{type(e).__name__}: {e}"
            logger.warning("varlen flash attention failed (%s); packed attention falls back to padded SDPA",
                           _varlen_error)
    return _padded_sdpa(query, key, value, cu, scaling, softcap, window)


def _mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """HF mask for padded batches; none at all for packed ones (they carry `cu_seqlens` instead)."""
    if kwargs.get("attention_mask") is None:
        return None
    return sdpa_mask(*args, **kwargs)


def register() -> str:
    """Register the implementation with transformers (idempotent); returns its name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _mask)
    return ATTN_IMPLEMENTATION
