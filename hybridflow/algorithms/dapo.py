"""DAPO extras (Yu et al. 2025): soft overlong reward shaping and the dynamic-sampling group filter.

Decision: both are pure functions on [B] tensors plus uids; the trainer decides when to resample — the filter
only says which rows to keep and how many groups it dropped (`frac_groups_filtered`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from hybridflow.algorithms.grouping import group_stats


def overlong_penalty(
    response_lengths: Tensor,
    max_response_length: int,
    overlong_buffer_len: int,
    overlong_penalty_factor: float = 1.0,
) -> Tensor:
    """Reward to *add* per response ([B], ≤ 0): linear in the length past `max_response_length - buffer`.

    0 up to L_max - buffer, then -(len - (L_max - buffer)) / buffer · factor, reaching -factor at L_max.
    """
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(
            f"overlong_buffer_len={overlong_buffer_len} must be in (0, max_response_length={max_response_length}]"
        )
    if overlong_penalty_factor < 0:
        raise ValueError(f"overlong_penalty_factor={overlong_penalty_factor} must be >= 0 (it is subtracted)")
    expected = max_response_length - overlong_buffer_len
    exceed = (response_lengths if response_lengths.is_floating_point() else response_lengths.float()) - expected
    return torch.clamp(-exceed / overlong_buffer_len * overlong_penalty_factor, max=0.0)


def filter_uninformative_groups(
    rewards: Tensor,
    index: np.ndarray | Sequence | Tensor,
    keep_singletons: bool = True,
    atol: float = 0.0,
) -> tuple[Tensor, float]:
    """Dynamic sampling: drop groups whose rewards are all equal (their group-relative advantage is 0).

    `rewards` is one score per response ([B]); returns (keep_mask [B] bool, fraction of groups dropped).
    Groups of size 1 are kept by default (`keep_singletons`), as in the DAPO recipe, so `rollout.n=1` runs are
    not emptied; equality is max - min <= `atol`.
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be one score per response ([B]), got shape {tuple(rewards.shape)}")
    if len(rewards) == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards.device), 0.0
    st = group_stats(rewards.float(), index)
    flat = (st.max - st.min) <= atol
    if keep_singletons:
        flat &= st.count > 1
    keep = ~flat
    dropped = torch.zeros(st.num_groups, dtype=torch.bool, device=rewards.device)
    dropped[st.group_id[flat]] = True
    return keep, float(dropped.float().mean())
