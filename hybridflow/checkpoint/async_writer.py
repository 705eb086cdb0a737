"""How a save runs off the training path: a one-in-flight background writer and the rank votes of its phases.

`AsyncWriter.submit` first waits for the previous job (at most one save in flight, the staging buffers free). A
failed job raises `CheckpointWriteError` from the next `poll`/`submit`/`wait` — errors are never dropped; the
thread is non-daemon, so exit waits for the last save, and an atexit hook logs an error nobody collected.
Saves use their own gloo group (never the training group, whose NCCL collectives must not interleave with ours);
each phase ends with an all-reduce of "ok" flags, so a failure on any rank raises on every rank instead of leaving
the others blocked in the next collective.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)
T = TypeVar("T")


class CheckpointWriteError(RuntimeError):
    """A checkpoint write failed (raised in the training thread, chained to the writer's exception)."""


class AsyncWriter:
    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._label = ""
        self.last_duration_s = 0.0
        atexit.register(_wait_at_exit, weakref.ref(self))

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Callable[[], None], label: str) -> None:
        """Wait for (and surface errors of) the previous job, then start `job` in the background."""
        self.wait()
        self._label = label
        self._thread = threading.Thread(target=self._run, args=(job, time.perf_counter()), name="checkpoint-writer")
        self._thread.start()

    def _run(self, job: Callable[[], None], started: float) -> None:
        try:
            job()
        except BaseException as err:  # noqa: BLE001 — stored and re-raised in the owner's thread
            logger.error("background checkpoint write (%s) failed: %r", self._label, err)
            self._error = err
        finally:
            self.last_duration_s = time.perf_counter() - started

    def poll(self) -> None:
        """Never blocks: raise `CheckpointWriteError` now if a finished job failed (call once per training step)."""
        if not self.busy:
            self.wait()

    def wait(self) -> None:
        """Block until the in-flight job ends; raise `CheckpointWriteError` if it (or an earlier one) failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointWriteError(f"checkpoint save failed ({self._label}): {type(err).__name__}: {err}") from err


def _wait_at_exit(ref: weakref.ref) -> None:
    writer = ref()
    try:
        if writer is not None:
            writer.wait()
    except CheckpointWriteError as err:
        logger.error("%s (reported at exit because close() was not called)", err)


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
