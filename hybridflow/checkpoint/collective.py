"""Rank bookkeeping for checkpoint saves: a dedicated gloo group and a vote after each save phase.

Saves may run in a background thread, so they use their own gloo group (never the training group, whose NCCL
collectives must not interleave with ours). Each phase ends with an all-reduce of "ok" flags, so a failure on any
rank raises on every rank instead of leaving the others blocked in the next collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class RankFailure(RuntimeError):
    """Another rank failed during a collective checkpoint phase."""


def make_group() -> dist.ProcessGroup | None:
    """A new gloo group over all ranks when torch.distributed is initialised (collective: call on every rank)."""
    return dist.new_group(backend="gloo") if dist.is_available() and dist.is_initialized() else None


def rank_and_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))


def vote(ok: bool, group: dist.ProcessGroup | None) -> bool:
    """True iff `ok` on every rank of `group` (also a barrier)."""
    if group is None:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def phase(name: str, fn: Callable[[], T], group: dist.ProcessGroup | None) -> T | None:
    """Run `fn` on this rank, then agree across ranks; re-raise a local error, or `RankFailure` for a remote one."""
    result: T | None = None
    error: BaseException | None = None
    try:
        result = fn()
    except Exception as err:  # noqa: BLE001 — must reach the vote so other ranks do not hang; re-raised below
        error = err
    all_ok = vote(error is None, group)
    if error is not None:
        raise error
    if not all_ok:
        raise RankFailure(f"checkpoint phase '{name}' failed on another rank (see that rank's log)")
    return result


def barrier(group: dist.ProcessGroup | None) -> None:
    vote(True, group)
