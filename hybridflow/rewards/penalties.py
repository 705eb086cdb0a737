"""Length-based reward shaping, as pure functions of response lengths (tokens).

* length penalty: `-coef * length / max_response_length` (a linear cost per token).
* DAPO overlong buffer: no penalty up to `max_response_length - buffer_len`, then a linear ramp to
  `-penalty_factor` at `max_response_length` (soft overlong punishment, DAPO eq. 13).
"""

from __future__ import annotations

import numpy as np
import torch

from hybridflow.algorithms import dapo


def length_penalty(lengths: np.ndarray, coef: float, max_response_length: int) -> np.ndarray:
    return -coef * lengths.astype(np.float64) / max_response_length


def overlong_penalty(lengths: np.ndarray, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> np.ndarray:
    """`hybridflow.algorithms.overlong_penalty` (the one implementation) on numpy lengths, errors in config keys."""
    if not 0 < buffer_len <= max_response_length:
        raise ValueError(f"reward.overlong_buffer.len={buffer_len}: must be in [1, data.max_response_length="
                         f"{max_response_length}]")
    lengths_t = torch.as_tensor(np.asarray(lengths), dtype=torch.float64)
    return dapo.overlong_penalty(lengths_t, max_response_length, buffer_len, penalty_factor).double().numpy()
