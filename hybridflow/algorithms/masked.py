"""Masked reductions (sum/mean/var/whiten) and numerically stable entropy from logits.

Decision: an empty mask gives 0 (never NaN) so fully padded rows or micro-batches are harmless; variance of fewer
than two elements is 0. Entropy uses log-sum-exp and treats 0·log 0 as 0, so `-inf` logits are fine.
Legend: B batch, T response length, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `values` where `mask` is non-zero (mask may be bool or float weights)."""
    prod = values * mask.to(values.dtype)
    return prod.sum() if dim is None else prod.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over masked elements; 0 where the mask is empty."""
    m = mask.to(values.dtype)
    total = masked_sum(values, m, dim)
    count = m.sum() if dim is None else m.sum(dim)
    safe = torch.where(count > 0, count, torch.ones_like(count))
    return torch.where(count > 0, total / safe, torch.zeros_like(total))


def _masked_mean_var(values: Tensor, m: Tensor, unbiased: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(mean, var, values - mean) in two passes; var is 0 for fewer than two elements."""
    n = m.sum()
    total = (values * m).sum()
    mean = torch.where(n > 0, total / torch.where(n > 0, n, torch.ones_like(n)), torch.zeros_like(total))
    centred = values - mean
    sq = centred.square()
    sq = sq.mul_(m) if not sq.requires_grad else sq * m
    denom = n - 1 if unbiased else n
    var = torch.where(n > 1, sq.sum() / torch.clamp(denom, min=1), torch.zeros_like(total))
    return mean, var, centred


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance over all masked elements (Bessel-corrected if `unbiased`); 0 when fewer than two elements."""
    return _masked_mean_var(values, mask.to(values.dtype), unbiased)[1]


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(values - mean) / sqrt(var + eps) with masked statistics (unbiased var); add the mean back if not `shift_mean`.

    Positions outside the mask are transformed too (callers multiply by the mask when they need zeros there).
    """
    mean, var, centred = _masked_mean_var(values, mask.to(values.dtype), unbiased=True)
    scale = torch.rsqrt(var + eps)
    whitened = centred.mul_(scale) if not centred.requires_grad else centred * scale
    return whitened if shift_mean else whitened + mean


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: [..., V] → [...], computed in float32 or wider."""
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    logp = F.log_softmax(x, dim=-1)
    p = logp.exp()
    # p·log p with p == 0 (logit -inf) is 0, not NaN.
    plogp = torch.where(p > 0, p * logp, torch.zeros_like(p))
    return -plogp.sum(-1)


def entropy_from_logits_chunked(logits: Tensor, chunk_size: int = 1024) -> Tensor:
    """`entropy_from_logits` over the flattened leading dims in chunks of `chunk_size` rows.

    Bounds the float32 softmax temporaries to one chunk ([chunk, V]); under autograd each chunk is
    recomputed in backward (activation checkpointing) so the saved activations stay bounded too.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be positive; use e.g. 1024")
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    use_ckpt = torch.is_grad_enabled() and flat.requires_grad
    out = []
    for chunk in flat.split(chunk_size, dim=0):
        if use_ckpt:
            out.append(checkpoint(entropy_from_logits, chunk, use_reentrant=False))
        else:
            out.append(entropy_from_logits(chunk))
    if not out:
        return flat.new_zeros(lead, dtype=torch.float32)
    return torch.cat(out).reshape(lead)
