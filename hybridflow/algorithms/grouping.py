"""Per-group statistics of sequence scores, where a group is all responses sharing one prompt `uid`.

Decision: groups are mapped to dense ids once (`np.unique`) and reduced with `index_add_`, so GRPO/RLOO/DAPO
filtering are O(B) tensor ops with no Python loop over groups. Statistics are computed in float64.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class GroupStats:
    """Per-row view of its group's statistics (all shaped [B])."""

    group_id: Tensor  # dense group index in [0, num_groups)
    count: Tensor  # group size
    mean: Tensor
    std: Tensor  # unbiased (Bessel); 0 for groups of size 1
    min: Tensor
    max: Tensor
    num_groups: int


def dense_group_ids(index: np.ndarray | Sequence | Tensor, device: torch.device | None = None) -> tuple[Tensor, int]:
    """Map arbitrary uids (str, int, ...) to dense ids 0..G-1; returns (ids[B], G)."""
    if isinstance(index, Tensor):
        index = index.detach().cpu().numpy()
    arr = np.asarray(index)
    if arr.ndim != 1:
        raise ValueError(f"index must be one uid per row (1-D), got shape {arr.shape}")
    if arr.dtype == object:
        arr = arr.astype(str)
    _, inverse = np.unique(arr, return_inverse=True)
    ids = torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device)
    return ids, int(inverse.max()) + 1 if inverse.size else 0


def group_stats(scores_B: Tensor, index: np.ndarray | Sequence | Tensor) -> GroupStats:
    """Mean, unbiased std, min, max and size of each row's group, broadcast back to rows."""
    if scores_B.ndim != 1 or len(scores_B) != len(index):
        raise ValueError(f"scores shape {tuple(scores_B.shape)} must be [B] with B == len(index) == {len(index)}")
    ids, G = dense_group_ids(index, device=scores_B.device)
    x = scores_B.detach().double()
    count = torch.zeros(G, dtype=torch.float64, device=x.device).index_add_(0, ids, torch.ones_like(x))
    mean = torch.zeros_like(count).index_add_(0, ids, x) / count
    sq = torch.zeros_like(count).index_add_(0, ids, (x - mean[ids]) ** 2)
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))
    gmin = torch.full_like(count, float("inf")).scatter_reduce(0, ids, x, reduce="amin")
    gmax = torch.full_like(count, float("-inf")).scatter_reduce(0, ids, x, reduce="amax")
    dtype = scores_B.dtype
    return GroupStats(
        group_id=ids,
        count=count[ids].to(dtype),
        mean=mean[ids].to(dtype),
        std=std[ids].to(dtype),
        min=gmin[ids].to(dtype),
        max=gmax[ids].to(dtype),
        num_groups=G,
    )
