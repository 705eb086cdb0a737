"""Index normalisation and value helpers for `DataProto`.

Every row selector (int list, numpy array, tensor, bool mask) becomes one CPU int64 tensor, so tensors and numpy
columns are gathered with the same indices; negative indices wrap like Python's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

IndexLike = Sequence[int] | Sequence[bool] | np.ndarray | torch.Tensor | range


def as_index_tensor(idx: IndexLike, n: int) -> torch.Tensor:
    """Row indices (CPU int64, non-negative) for a selector over `n` rows; a bool mask must have length n."""
    if isinstance(idx, torch.Tensor):
        t = idx.detach().cpu()
    elif isinstance(idx, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(idx))
    elif isinstance(idx, range | list | tuple):
        values = list(idx)
        is_mask = len(values) > 0 and all(isinstance(v, bool | np.bool_) for v in values)
        t = torch.tensor(values, dtype=torch.bool if is_mask else torch.int64)
    else:
        raise TypeError(f"DataProto index must be an int, slice, list, range, np.ndarray or torch.Tensor; "
                        f"got {type(idx).__name__}")
    if t.ndim != 1:
        raise ValueError(f"DataProto index must be 1-D, got shape {list(t.shape)}")
    if t.dtype == torch.bool:
        if t.numel() != n:
            raise ValueError(f"bool mask has length {t.numel()} but the DataProto has {n} rows")
        return t.nonzero().flatten()
    if t.is_floating_point() or t.is_complex():
        raise TypeError(f"DataProto index must hold integers or bools, got dtype {t.dtype}")
    t = t.to(torch.int64)
    if t.numel() and (int(t.min()) < -n or int(t.max()) >= n):
        raise IndexError(f"DataProto index out of range for {n} rows: min {int(t.min())}, max {int(t.max())}")
    return torch.where(t < 0, t + n, t)


def to_object_array(values: Any) -> np.ndarray:
    """A 1-D object array with one element per item; numpy arrays are returned unchanged.

    Filled element by element because `np.array(list_of_equal_length_lists, dtype=object)` silently builds 2-D.
    """
    if isinstance(values, np.ndarray):
        return values
    items = list(values)
    out = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        out[i] = item
    return out


def values_equal(a: Any, b: Any) -> bool:
    """Deep equality for tensors, numpy arrays (object arrays elementwise), dicts, lists and plain values. A NaN
    equals a NaN in the same place: a copy of a tensor holding NaN (a diverged model's log-probs) is the same value,
    and the non-finite guard, not an equality check, is what reports it."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype):
            return False
        b = b.to(a.device)
        if a.is_floating_point() or a.is_complex():
            return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
        return torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        if a.dtype == object or b.dtype == object:
            return all(values_equal(x, y) for x, y in zip(a.reshape(-1), b.reshape(-1)))
        return bool(np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(values_equal(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except (TypeError, ValueError):  # objects whose == is not a plain truth value
        return False
