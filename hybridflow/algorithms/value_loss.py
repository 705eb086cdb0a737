"""Clipped critic loss: 0.5 · agg(max((v - R)², (clip(v, v_old ± ε) - R)²)), with `vf_clipfrac`.

Decision: same aggregation (and global normaliser) as the policy loss, so critic gradients are split-invariant
too; `cliprange_value=None` turns clipping off.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybridflow.algorithms.aggregation import agg_loss
from hybridflow.algorithms.masked import masked_mean


def compute_value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    response_mask: Tensor,
    cliprange_value: float | None = 0.5,
    loss_agg_mode: str = "token-mean",
    global_normalizer: Tensor | float | None = None,
    max_len: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`vpreds` current critic outputs, `values` the rollout-time (old) values, `returns` the targets, all [B, T].

    Metrics (detached 0-d tensors): `vf_clipfrac` (share of tokens where the clipped error was larger),
    `vpred_mean`.
    """
    if cliprange_value is not None and cliprange_value < 0:
        raise ValueError(f"critic.cliprange_value={cliprange_value} must be >= 0, or null to disable clipping")
    loss_unclipped = (vpreds - returns).square()
    if cliprange_value is None:
        per_token = loss_unclipped
        clipfrac = torch.zeros((), device=vpreds.device)
    else:
        vclipped = values + torch.clamp(vpreds - values, -cliprange_value, cliprange_value)
        loss_clipped = (vclipped - returns).square()
        per_token = torch.maximum(loss_unclipped, loss_clipped)
        clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask).detach()
    loss = 0.5 * agg_loss(per_token, response_mask, loss_agg_mode, global_normalizer=global_normalizer, max_len=max_len)
    metrics = {"vf_clipfrac": clipfrac, "vpred_mean": masked_mean(vpreds.detach(), response_mask)}
    return loss, metrics
