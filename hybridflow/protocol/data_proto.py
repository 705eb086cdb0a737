"""`DataProto`: the one batch type exchanged between the driver and the workers (verl-compatible API).

`batch` is a plain `dict[str, torch.Tensor]` (no tensordict dependency), `non_tensor_batch` a
`dict[str, np.ndarray]` (object arrays for strings/dicts), `meta_info` a free dict. Every column shares dim 0.
Design decision: row slices and chunks are *views* (O(1), share storage); index lists and masks gather copies.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from os import PathLike
from typing import Any

import numpy as np
import torch

from hybridflow.protocol import serialization
from hybridflow.protocol.indexing import IndexLike, as_index_tensor, to_object_array, values_equal
from hybridflow.utils.device import to_device

logger = logging.getLogger(__name__)

KeysArg = str | Sequence[str] | None


def _key_list(keys: KeysArg) -> list[str]:
    if keys is None:
        return []
    return [keys] if isinstance(keys, str) else list(keys)


def _pick(columns: Mapping[str, Any], keys: KeysArg, where: str) -> dict[str, Any]:
    """Sub-dict for `keys` (all of `columns` when keys is None); a missing key names what exists."""
    if keys is None:
        return dict(columns)
    out = {}
    for key in _key_list(keys):
        if key not in columns:
            raise ValueError(f"{where} has no key {key!r}; available: {sorted(columns)}")
        out[key] = columns[key]
    return out


@dataclass(eq=False)
class DataProtoItem:
    """One row of a DataProto: tensor rows (views), non-tensor elements and the parent's meta_info."""

    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class DataProto:
    """Columns of equal length: tensors in `batch`, numpy arrays in `non_tensor_batch`, plus `meta_info`."""

    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Accept None (verl style) and TensorDict-like mappings, but store plain dicts.
        self.batch = {} if self.batch is None else dict(self.batch.items())
        self.non_tensor_batch = {} if self.non_tensor_batch is None else dict(self.non_tensor_batch)
        self.meta_info = {} if self.meta_info is None else self.meta_info
        self.check_consistency()

    # ----------------------------------------------------------------------------------------- construction
    def check_consistency(self) -> None:
        """Raise if a column is of the wrong type or its dim 0 differs from the others."""
        first: tuple[str, int] | None = None
        columns = [("batch", k, v) for k, v in self.batch.items()]
        columns += [("non_tensor_batch", k, v) for k, v in self.non_tensor_batch.items()]
        for where, key, value in columns:
            kind = torch.Tensor if where == "batch" else np.ndarray
            if not isinstance(value, kind):
                fix = "" if where == "batch" else "; wrap it with np.array(values, dtype=object)"
                raise TypeError(f"{where}[{key!r}] must be a {kind.__module__}.{kind.__name__}, "
                                f"got {type(value).__name__}{fix}")
            if value.ndim == 0:
                raise ValueError(f"{where}[{key!r}] is 0-dimensional; DataProto columns need a batch dim 0 "
                                 "(put scalars in meta_info)")
            name = f"{where}[{key!r}]"
            if first is None:
                first = (name, value.shape[0])
            elif value.shape[0] != first[1]:
                raise ValueError(f"DataProto columns must share dim 0: {name} has {value.shape[0]} rows "
                                 f"but {first[0]} has {first[1]} rows")

    @classmethod
    def empty(cls, meta_info: dict[str, Any] | None = None) -> DataProto:
        """A DataProto without columns (length 0), e.g. to broadcast only `meta_info`."""
        return cls(meta_info=meta_info or {})

    @classmethod
    def from_dict(cls, tensors: Mapping[str, torch.Tensor] | None = None,
                  non_tensors: Mapping[str, Any] | None = None,
                  meta_info: dict[str, Any] | None = None) -> DataProto:
        """Build from separate tensor / non-tensor dicts; lists become 1-D object arrays."""
        non = {k: to_object_array(v) for k, v in (non_tensors or {}).items()}
        return cls(batch=dict(tensors or {}), non_tensor_batch=non, meta_info=meta_info or {})

    @classmethod
    def from_single_dict(cls, data: Mapping[str, Any], meta_info: dict[str, Any] | None = None) -> DataProto:
        """Build from one dict: tensors go to `batch`, numpy arrays and lists to `non_tensor_batch`."""
        tensors, non_tensors = {}, {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, np.ndarray | list | tuple):
                non_tensors[key] = value
            else:
                raise TypeError(f"from_single_dict: {key!r} is a {type(value).__name__}; expected a torch.Tensor, "
                                "np.ndarray or list (put scalars in meta_info)")
        return cls.from_dict(tensors, non_tensors, meta_info)

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]], meta_info: dict[str, Any] | None = None) -> DataProto:
        """Collate a list of per-row dicts: tensor values are stacked, anything else goes to an object array."""
        if len(rows) == 0:
            return cls.empty(meta_info)
        keys = list(rows[0])
        for i, row in enumerate(rows):
            if set(row) != set(keys):
                raise ValueError(f"from_rows: row {i} has keys {sorted(row)} but row 0 has {sorted(keys)}")
        tensors, non_tensors = {}, {}
        for key in keys:
            values = [row[key] for row in rows]
            n_tensors = sum(isinstance(v, torch.Tensor) for v in values)
            if n_tensors == len(values):
                try:
                    tensors[key] = torch.stack(values)
                except RuntimeError as err:
                    raise ValueError(f"from_rows: cannot stack the tensors of {key!r}: {err}") from err
            elif n_tensors == 0:
                non_tensors[key] = values
            else:
                raise TypeError(f"from_rows: {key!r} mixes tensors and non-tensors across rows")
        return cls.from_dict(tensors, non_tensors, meta_info)

    # ------------------------------------------------------------------------------------------------ basics
    def __len__(self) -> int:
        for value in self.batch.values():
            return value.shape[0]
        for value in self.non_tensor_batch.values():
            return value.shape[0]
        return 0

    @property
    def batch_size(self) -> int:
        return len(self)

    def keys(self) -> list[str]:
        """Tensor keys then non-tensor keys."""
        return [*self.batch, *self.non_tensor_batch]

    def __contains__(self, key: object) -> bool:
        return key in self.batch or key in self.non_tensor_batch

    def _has_columns(self) -> bool:
        return bool(self.batch or self.non_tensor_batch)

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}: {str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
                            for k, v in self.batch.items())
        arrays = ", ".join(f"{k}: {v.dtype}{list(v.shape)}" for k, v in self.non_tensor_batch.items())
        return (f"DataProto(len={len(self)}, batch={{{tensors}}}, non_tensor_batch={{{arrays}}}, "
                f"meta_info_keys={list(self.meta_info)})")

    # -------------------------------------------------------------------------------------------- indexing
    def __getitem__(self, item: int | slice | IndexLike) -> DataProtoItem | DataProto:
        """int -> DataProtoItem (one row); slice -> DataProto view; list/array/tensor/bool mask -> copy."""
        if isinstance(item, slice):
            return self._slice(item)
        if isinstance(item, bool | np.bool_):
            raise TypeError("DataProto index must be an int, slice, index list/array/tensor or a bool mask, "
                            "not a bool")
        if isinstance(item, int | np.integer) or (isinstance(item, torch.Tensor) and item.ndim == 0
                                                  and item.dtype != torch.bool):
            return self._row(int(item))
        return self.select_idxs(item)

    def _row(self, i: int) -> DataProtoItem:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"DataProto index {i} is out of range for {n} rows")
        return DataProtoItem(batch={k: v[i] for k, v in self.batch.items()},
                             non_tensor_batch={k: v[i] for k, v in self.non_tensor_batch.items()},
                             meta_info=self.meta_info)

    def _slice(self, s: slice) -> DataProto:
        start, stop, step = s.indices(len(self))
        if step < 0:  # torch has no negative-step views; gather instead
            return self.select_idxs(torch.arange(start, stop, step))
        return DataProto(batch={k: v[start:stop:step] for k, v in self.batch.items()},
                         non_tensor_batch={k: v[start:stop:step] for k, v in self.non_tensor_batch.items()},
                         meta_info=dict(self.meta_info))

    def _gathered(self, idx: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
        per_device: dict[torch.device, torch.Tensor] = {}
        batch = {}
        for key, value in self.batch.items():
            if value.device not in per_device:
                per_device[value.device] = idx.to(value.device)
            batch[key] = value.index_select(0, per_device[value.device])
        idx_np = idx.numpy()
        return batch, {k: v[idx_np] for k, v in self.non_tensor_batch.items()}

    def select_idxs(self, idxs: IndexLike) -> DataProto:
        """Rows at `idxs` (ints, or a bool mask of length len(self)) as a new DataProto (copy)."""
        batch, non = self._gathered(as_index_tensor(idxs, len(self)))
        return DataProto(batch=batch, non_tensor_batch=non, meta_info=dict(self.meta_info))

    def reorder(self, indices: IndexLike) -> None:
        """In place: replace every column by its rows at `indices` (like verl)."""
        self.batch, self.non_tensor_batch = self._gathered(as_index_tensor(indices, len(self)))

    # ----------------------------------------------------------------------------------------------- keys
    def select(self, batch_keys: KeysArg = None, non_tensor_batch_keys: KeysArg = None,
               meta_info_keys: KeysArg = None, deepcopy: bool = False) -> DataProto:
        """A DataProto with only these keys (None keeps all of that part); columns are shared unless deepcopy."""
        batch = _pick(self.batch, batch_keys, "batch")
        non = _pick(self.non_tensor_batch, non_tensor_batch_keys, "non_tensor_batch")
        meta = _pick(self.meta_info, meta_info_keys, "meta_info")
        if deepcopy:
            batch = {k: v.clone() for k, v in batch.items()}
            non, meta = copy.deepcopy(non), copy.deepcopy(meta)
        return DataProto(batch=batch, non_tensor_batch=non, meta_info=meta)

    def pop(self, batch_keys: KeysArg = None, non_tensor_batch_keys: KeysArg = None,
            meta_info_keys: KeysArg = None) -> DataProto:
        """Remove these keys from self and return them as a new DataProto (None pops nothing)."""
        out = self.select(_key_list(batch_keys), _key_list(non_tensor_batch_keys), _key_list(meta_info_keys))
        for key in out.batch:
            del self.batch[key]
        for key in out.non_tensor_batch:
            del self.non_tensor_batch[key]
        for key in out.meta_info:
            del self.meta_info[key]
        return out

    def rename(self, old_keys: KeysArg = None, new_keys: KeysArg = None) -> DataProto:
        """In place: rename columns (tensor or non-tensor) `old_keys[i]` -> `new_keys[i]`; returns self."""
        old, new = _key_list(old_keys), _key_list(new_keys)
        if len(old) != len(new):
            raise ValueError(f"rename: {len(old)} old keys {old} but {len(new)} new keys {new}")
        for o, n in zip(old, new):
            part = self.batch if o in self.batch else self.non_tensor_batch
            if o not in part:
                raise ValueError(f"rename: no column {o!r}; available: {self.keys()}")
            if n != o and n in self:
                raise ValueError(f"rename: {o!r} -> {n!r} would overwrite the existing column {n!r}; pop it first")
            part[n] = part.pop(o)
        return self

    def union(self, other: DataProto) -> DataProto:
        """In place: add `other`'s columns and meta_info to self; returns self. Equal shared keys are fine."""
        if self._has_columns() and other._has_columns() and len(self) != len(other):
            raise ValueError(f"union: lengths differ ({len(self)} vs {len(other)} rows)")
        for where, mine, theirs in (("batch", self.batch, other.batch),
                                    ("non_tensor_batch", self.non_tensor_batch, other.non_tensor_batch),
                                    ("meta_info", self.meta_info, other.meta_info)):
            for key, value in theirs.items():
                if key in mine and not values_equal(mine[key], value):
                    raise ValueError(f"union: {where}[{key!r}] differs between the two DataProtos; "
                                     "rename() or pop() it on one side first")
        self.batch.update(other.batch)
        self.non_tensor_batch.update(other.non_tensor_batch)
        self.meta_info.update(other.meta_info)
        return self

    # ----------------------------------------------------------------------------------- split and combine
    def chunk(self, chunks: int) -> list[DataProto]:
        """`chunks` equal views of the rows; len(self) must be divisible (see `pad_to_divisor`)."""
        if chunks <= 0:
            raise ValueError(f"chunk: chunks must be >= 1, got {chunks}")
        n = len(self)
        if n % chunks:
            raise ValueError(f"chunk({chunks}): {n} rows are not divisible by {chunks}; pad first with "
                             f"`padded, pad_size = data.pad_to_divisor({chunks})` and `unpad(pad_size)` the result")
        size = n // chunks
        return [self._slice(slice(i * size, (i + 1) * size)) for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Consecutive views of `split_size` rows each; the last may be shorter."""
        if split_size <= 0:
            raise ValueError(f"split: split_size must be >= 1, got {split_size}")
        return [self._slice(slice(i, i + split_size)) for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Rows of all parts in order (copies). meta_info keeps keys equal in every part; `metrics` are merged."""
        if len(data) == 0:
            raise ValueError("concat: need at least one DataProto")
        first = data[0]
        for i, part in enumerate(data[1:], start=1):
            for where, a, b in (("batch", first.batch, part.batch),
                                ("non_tensor_batch", first.non_tensor_batch, part.non_tensor_batch)):
                if set(a) != set(b):
                    raise ValueError(f"concat: part {i} has {where} keys {sorted(b)} but part 0 has {sorted(a)}")
        batch = {k: torch.cat([d.batch[k] for d in data]) for k in first.batch}
        non = {k: np.concatenate([d.non_tensor_batch[k] for d in data]) for k in first.non_tensor_batch}
        return DataProto(batch=batch, non_tensor_batch=non, meta_info=_merge_meta([d.meta_info for d in data]))

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Each row `repeat_times` times: interleaved (a a b b) or blocked (a b a b). Copies."""
        if repeat_times < 1:
            raise ValueError(f"repeat: repeat_times must be >= 1, got {repeat_times}")
        if interleave:
            batch = {k: v.repeat_interleave(repeat_times, dim=0) for k, v in self.batch.items()}
            non = {k: np.repeat(v, repeat_times, axis=0) for k, v in self.non_tensor_batch.items()}
        else:
            batch = {k: v.repeat(repeat_times, *([1] * (v.ndim - 1))) for k, v in self.batch.items()}
            non = {k: np.tile(v, (repeat_times,) + (1,) * (v.ndim - 1)) for k, v in self.non_tensor_batch.items()}
        return DataProto(batch=batch, non_tensor_batch=non, meta_info=dict(self.meta_info))

    def pad_to_divisor(self, size_divisor: int) -> tuple[DataProto, int]:
        """Pad by repeating leading rows (like verl) so len % size_divisor == 0; returns (padded, pad_size)."""
        if size_divisor <= 0:
            raise ValueError(f"pad_to_divisor: size_divisor must be >= 1, got {size_divisor}")
        n = len(self)
        pad_size = -n % size_divisor
        if pad_size == 0:  # includes n == 0
            return self, 0
        parts, remaining = [self], pad_size
        while remaining > 0:
            take = min(remaining, n)
            parts.append(self._slice(slice(0, take)))
            remaining -= take
        padded = DataProto.concat(parts)
        padded.meta_info = dict(self.meta_info)  # concat would repeat `metrics` once per part
        return padded, pad_size

    def unpad(self, pad_size: int) -> DataProto:
        """Drop the last `pad_size` rows (a view); inverse of `pad_to_divisor`."""
        if not 0 <= pad_size <= len(self):
            raise ValueError(f"unpad: pad_size must be in [0, {len(self)}], got {pad_size}")
        return self._slice(slice(0, len(self) - pad_size))

    # ------------------------------------------------------------------------------------ device and epochs
    def to(self, device: str | torch.device, non_blocking: bool = False) -> DataProto:
        """In place: move every tensor to `device`; returns self (like verl). `non_blocking` copies CPU tensors to
        a GPU from pinned memory, queued behind the running kernels (the host does not wait)."""
        move = to_device if non_blocking else (lambda v, d: v.to(d))
        self.batch = {k: move(v, device) for k, v in self.batch.items()}
        return self

    def make_iterator(self, mini_batch_size: int, epochs: int, seed: int | None = None,
                      shuffle: bool = True) -> Iterator[DataProto]:
        """Yield `epochs * len/mini_batch_size` mini-batches; a fixed `seed` gives the same order every call."""
        n = len(self)
        if mini_batch_size <= 0 or n % mini_batch_size:
            raise ValueError(f"make_iterator: {n} rows are not divisible by mini_batch_size={mini_batch_size}; "
                             "choose a divisor or pad with pad_to_divisor(mini_batch_size)")
        if epochs < 0:
            raise ValueError(f"make_iterator: epochs must be >= 0, got {epochs}")
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        return self._iterate(mini_batch_size, epochs, generator, shuffle)

    def _iterate(self, mini_batch_size: int, epochs: int, generator: torch.Generator | None,
                 shuffle: bool) -> Iterator[DataProto]:
        n = len(self)
        for _ in range(epochs):
            if not shuffle:
                yield from self.split(mini_batch_size)
                continue
            perm = torch.randperm(n, generator=generator)
            for start in range(0, n, mini_batch_size):
                yield self.select_idxs(perm[start:start + mini_batch_size])

    # ------------------------------------------------------------------------------------------------- disk
    def save(self, path: str | PathLike[str]) -> None:
        """Write to directory `path`: tensors as safetensors, non-tensors and meta_info as JSON (no pickle)."""
        serialization.save(path, self.batch, self.non_tensor_batch, self.meta_info, len(self))

    @classmethod
    def load(cls, path: str | PathLike[str], device: str | torch.device = "cpu") -> DataProto:
        """Read a directory written by `save`; never executes code from the files."""
        batch, non, meta = serialization.load(path, device)
        return cls(batch=batch, non_tensor_batch=non, meta_info=meta)

    def to_state(self) -> dict[str, Any]:
        """As a checkpoint state: tensors plus JSON (what `save` writes, for a checkpoint component or payload)."""
        return serialization.to_state(self.batch, self.non_tensor_batch, self.meta_info, len(self))

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> DataProto:
        """Inverse of `to_state`."""
        batch, non, meta = serialization.from_state(state)
        return cls(batch=batch, non_tensor_batch=non, meta_info=meta)


def _merge_meta(metas: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Keys whose value is equal in every part; `metrics` (dict or list per part) merged into one list."""
    merged: dict[str, Any] = {}
    for key, value in metas[0].items():
        if key == "metrics":
            continue
        if all(key in m and values_equal(m[key], value) for m in metas[1:]):
            merged[key] = value
        else:
            logger.debug("concat: dropping meta_info[%r], which differs between parts", key)
    metrics: list[Any] = []
    for meta in metas:
        found = meta.get("metrics")
        if isinstance(found, list):
            metrics.extend(found)
        elif found is not None:
            metrics.append(found)
    if any("metrics" in m for m in metas):
        merged["metrics"] = metrics
    return merged


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """verl-compatible function form of `DataProto.pad_to_divisor`."""
    return data.pad_to_divisor(size_divisor)


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """verl-compatible function form of `DataProto.unpad`."""
    return data.unpad(pad_size)
