"""One-in-flight background writer: run a write job in a thread; its error re-raises at the next call.

`submit` first waits for the previous job (so at most one save is in flight and the staging buffers are free).
A failed job raises `CheckpointWriteError` from the next `poll`/`submit`/`wait` — errors are never dropped. The
thread is non-daemon, so interpreter exit also waits for the last save; if the owner never calls `wait`, an
atexit hook logs a pending error instead of losing it.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable

logger = logging.getLogger(__name__)


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
