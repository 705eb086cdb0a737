"""Late columns: tensor columns that reach a worker call after it started, within one process.

Decision: in an on-policy GRPO step there is no old-log-prob, reference or value pass for the host's rule reward to
overlap with, so the GPU would wait for the reward and the advantages. Instead the driver calls the actor's update
at once with a batch that lacks the advantages and carries a token (`META_KEY` in `meta_info`) for a function that
scores; the update queues its first forward, then calls that function (on the same thread: the host scores while the
device computes) and the loss reads the advantages from the scored batch. This needs the worker in the driver's process (the local backend): a token is only
valid in the process that offered it, and the trainer offers one only there.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from hybridflow.protocol.data_proto import DataProto
from hybridflow.protocol.indexing import values_equal

META_KEY = "late_columns"

LateFn = Callable[[], DataProto]

_lock = threading.Lock()
_pending: dict[str, LateFn] = {}
_ids = itertools.count()


def offer(fn: LateFn) -> str:
    """Register `fn` (returns the batch with the late columns, blocking until it exists); returns its token."""
    with _lock:
        token = f"late-{next(_ids)}"
        _pending[token] = fn
    return token


def discard(token: str) -> None:
    with _lock:
        _pending.pop(token, None)


def take(data: DataProto) -> LateFn | None:
    """The late-columns function a batch's `meta_info` names (removed from both), or None when it names none."""
    token = data.meta_info.pop(META_KEY, None)
    if token is None:
        return None
    with _lock:
        fn = _pending.pop(token, None)
    if fn is None:
        raise RuntimeError(f"meta_info[{META_KEY!r}]={token!r} names no late columns in this process: they are only "
                           "offered to in-process workers (the local backend)")
    return fn


def new_columns(batch: DataProto, late: DataProto) -> DataProto:
    """`late`'s tensor columns that `batch` lacks. The rows must be the same, in the same order, and a column both
    hold must not have changed (what the update already read would be stale): checked, not assumed."""
    if len(late) != len(batch):
        raise ValueError(f"late columns have {len(late)} rows, the batch {len(batch)}")
    for key in sorted(set(late.batch) & set(batch.batch)):
        if not values_equal(late.batch[key], batch.batch[key]):
            raise ValueError(f"late columns: {key!r} differs from the batch the update started with; the late "
                             "function may only add columns (or set reward.overlap=false)")
    return late.select([k for k in late.batch if k not in batch.batch], [], [])
