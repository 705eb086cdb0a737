"""Discounted reverse cumulative sums over the response axis (GAE, discounted returns), vectorised.

Decision: instead of a Python loop over T, a constant discount makes the scan a block matmul — each chunk of K
tokens is one [K, K] lower-triangular discount matrix, and the chunk boundaries are themselves a scan with
discount**K, solved recursively — so cost is O(B·T·K) flops in a few large ops. Masks with holes (multi-turn
observation tokens) are handled by packing valid tokens to the left first ("skip" semantics: a masked token
neither discounts nor contributes).
Legend: B batch, T response length, K chunk length, C number of chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_CHUNK = 64


def discounted_reverse_cumsum(x_BT: Tensor, discount: float, chunk_size: int = _CHUNK) -> Tensor:
    """out[:, t] = sum_{s >= t} discount**(s - t) * x[:, s] along the last dim."""
    if x_BT.ndim != 2:
        raise ValueError(f"expected a [batch, time] tensor, got shape {tuple(x_BT.shape)}")
    if chunk_size < 2:
        raise ValueError(f"chunk_size={chunk_size} must be >= 2 (the chunk-start scan recurses on T / chunk_size)")
    B, T = x_BT.shape
    if T == 0:
        return x_BT.clone()
    if discount == 0.0:
        return x_BT.clone()
    K = min(chunk_size, T)
    pad = (-T) % K
    x = F.pad(x_BT, (0, pad)) if pad else x_BT
    C = x.shape[1] // K
    idx = torch.arange(K, device=x.device)
    lag = idx[:, None] - idx[None, :]  # lag[s, t] = s - t
    powers = torch.tensor(discount, dtype=torch.float64, device=x.device) ** lag.clamp(min=0).double()
    D_KK = torch.where(lag >= 0, powers, torch.zeros_like(powers)).to(x.dtype)
    local_BCK = x.view(B, C, K) @ D_KK  # within-chunk scan, as if nothing follows the chunk
    if C == 1:
        return local_BCK.view(B, -1)[:, :T]
    # Value at each chunk start, including everything after it: a scan over chunk starts with discount**K.
    starts_BC = discounted_reverse_cumsum(local_BCK[:, :, 0].contiguous(), float(discount) ** K, chunk_size)
    next_start_BC = F.pad(starts_BC[:, 1:], (0, 1))
    decay_K = (torch.tensor(discount, dtype=torch.float64, device=x.device) ** (K - idx).double()).to(x.dtype)
    out_BCK = local_BCK.addcmul_(next_start_BC[:, :, None], decay_K)  # in place: no extra [B, T] buffer
    return out_BCK.reshape(B, -1)[:, :T]


def is_contiguous_mask(mask_BT: Tensor) -> bool:
    """True if every row's valid tokens form one contiguous block (no holes), e.g. right/left padding."""
    m = mask_BT.bool()
    rises = (m[:, 1:] & ~m[:, :-1]).sum(dim=1) + m[:, 0]
    return bool((rises <= 1).all())


def pack_left(mask_BT: Tensor) -> Tensor:
    """Permutation per row that moves valid tokens to the front, order preserved: use with gather/scatter."""
    return torch.argsort((~mask_BT.bool()).to(torch.int8), dim=1, stable=True)


def masked_discounted_returns(rewards_BT: Tensor, mask_BT: Tensor, gamma: float) -> Tensor:
    """Discounted reward-to-go over valid tokens only (masked tokens skipped); 0 outside the mask."""
    m = mask_BT.to(rewards_BT.dtype)
    if not is_contiguous_mask(mask_BT):
        order = pack_left(mask_BT)
        packed = masked_discounted_returns(rewards_BT.gather(1, order), mask_BT.gather(1, order), gamma)
        return torch.zeros_like(packed).scatter_(1, order, packed)
    return discounted_reverse_cumsum(rewards_BT * m, gamma) * m
