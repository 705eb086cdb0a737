"""Loss aggregation `agg_loss(loss_mat, mask, mode)` and the global normaliser that makes it split-invariant.

Decision: every mode is written as  (sum over this micro-batch of a per-token or per-sequence term) / N.
Without `global_normalizer`, N is the micro-batch's own count (a plain mean). With it, N is the count over the
whole mini-batch — all micro-batches on all data-parallel ranks — so summing the micro-batch losses (gradient
accumulation) and summing over ranks gives exactly the whole-batch loss, however the batch was split.

What N counts, per mode (`loss_normalizer` computes it for one mask; `global_loss_normalizer` for a mini-batch):
  token-mean               N = number of valid tokens (mask sum)
  seq-mean-token-sum       N = number of sequences with at least one valid token
  seq-mean-token-mean      N = number of sequences with at least one valid token
  seq-mean-token-sum-norm  N = number of sequences with at least one valid token; each sequence's token sum is
                           also divided by the constant `max_len` (Dr.GRPO; pass data.max_response_length)
Fully masked rows (padding added to divide a batch across ranks) never count.

DP note: the value is this micro-batch's *share* of the mini-batch loss, so gradients must be *summed* over
micro-batches and over DP ranks. FSDP/DDP average over ranks, so the engine multiplies the loss by the DP size
(or sets the gradient divide factor to 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={mode!r} is not supported; use one of {', '.join(LOSS_AGG_MODES)}")


def loss_normalizer(mask: Tensor, mode: str) -> Tensor:
    """This mask's contribution to N for `mode` (tokens for token-mean, non-empty sequences otherwise)."""
    _check_mode(mode)
    m = mask.float()
    if mode == "token-mean":
        return m.sum()
    return (m.sum(-1) > 0).float().sum()


def global_loss_normalizer(
    masks: Tensor | Sequence[Tensor],
    mode: str,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """N for a mini-batch: summed over its micro-batch `masks`, then all-reduced over `group` if distributed.

    `group` must be the data-parallel group (ranks holding *different* sequences); with sequence parallelism,
    pass the DP group, not the world. Without torch.distributed initialised this is the local count.
    """
    if isinstance(masks, Tensor):
        masks = [masks]
    if not masks:
        raise ValueError("global_loss_normalizer needs at least one micro-batch mask")
    n = torch.stack([loss_normalizer(m, mode) for m in masks]).sum()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(n, op=dist.ReduceOp.SUM, group=group)
    return n


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    global_normalizer: Tensor | float | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Aggregate a [B, T] per-token loss into a scalar (see the module docstring for each mode's N)."""
    _check_mode(mode)
    if loss_mat.shape != mask.shape:
        raise ValueError(f"loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} must have the same shape")
    m = mask.to(loss_mat.dtype)
    token_sum = loss_mat * m
    if mode == "token-mean":
        total = token_sum.sum()
    elif mode == "seq-mean-token-sum":
        total = token_sum.sum(-1).sum()
    elif mode == "seq-mean-token-mean":
        lengths = m.sum(-1)
        total = (token_sum.sum(-1) / torch.where(lengths > 0, lengths, torch.ones_like(lengths))).sum()
    else:
        norm = loss_mat.shape[-1] if max_len is None else max_len
        if norm <= 0:
            raise ValueError(f"max_len={max_len} must be positive for seq-mean-token-sum-norm")
        total = token_sum.sum(-1).sum() / norm
    n = loss_normalizer(mask, mode) if global_normalizer is None else global_normalizer
    n = torch.as_tensor(n, dtype=total.dtype, device=total.device)
    return total / torch.where(n > 0, n, torch.ones_like(n))
