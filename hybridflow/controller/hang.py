"""Hang watchdog: a driver thread that stops a run whose stage makes no progress for `trainer.hang_timeout_s`.

Every process keeps a progress record (`hybridflow.utils.progress`): the worker host marks each call, the engines
beat per micro-batch or decode step, the driver's stage timer marks stages. The thread reads the driver's record and
every watched worker group's (a Ray actor answers on its own thread while a call runs) each `poll_s`. A busy rank
whose record has not moved for the timeout, or a driver stage with no busy worker and no movement, is a hang: the
thread writes every process's Python stacks (faulthandler) under `dump_dir`, keeps a `HangError` naming the stage
and the rank, and makes the main thread raise it: Ray waits check it between slices of `poll_s`; a main thread stuck
in Python (an in-process worker, the driver's own code) gets a signal whose handler raises it. A main thread that
still has not left the run `exit_grace_s` later (stuck in C) is ended with `os._exit` after `on_unresponsive`.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

from hybridflow.controller.errors import HangError
from hybridflow.utils.progress import PROGRESS

if TYPE_CHECKING:
    from hybridflow.controller.backends.base import Backend

logger = logging.getLogger(__name__)

# torch.distributed's timeout with the watchdog off (the value every process group used before it existed).
COLLECTIVE_TIMEOUT_OFF_S = 600.0
EXIT_CODE = 70  # os._exit status of a run whose main thread did not stop after a hang (EX_SOFTWARE)
INTERRUPT_SIGNAL = signal.SIGUSR2
_DRIVER = ("", -1)

_ACTIVE: HangWatchdog | None = None


def active_watchdog() -> HangWatchdog | None:
    """The watchdog of the run open in this process, if any (backends check it while they wait)."""
    return _ACTIVE


def active_timeout_s() -> float:
    """The open run's hang timeout, 0.0 when no watchdog runs (backends hand it to the workers they start)."""
    return _ACTIVE.timeout_s if _ACTIVE is not None else 0.0


def collective_timeout_s(hang_timeout_s: float) -> float:
    """torch.distributed timeout for ranks of a run with this hang timeout: a little longer than it, so the watchdog
    (which dumps every rank's stacks and names the stage) acts before a collective fails on its own."""
    if hang_timeout_s <= 0:
        return COLLECTIVE_TIMEOUT_OFF_S
    return hang_timeout_s + max(60.0, 0.1 * hang_timeout_s)


def collective_wait(stacks: str) -> str | None:
    """The torch.distributed function a worker's call is blocked in (e.g. "all_reduce"), from its faulthandler text:
    the innermost frame of the thread running the call (the one through `WorkerHost.call`); None when it is not
    inside torch.distributed (NCCL's asynchronous collectives block later, at a device sync: None there too)."""
    for block in stacks.split("\n\n"):
        frames = _FRAME.findall(block)
        if frames and any(path.endswith(_HOST_FILE) and func == "call" for path, func in frames):
            path, func = frames[0]
            return func if "/torch/distributed/" in path.replace("\\", "/") else None
    return None


_FRAME = re.compile(r'File "([^"]+)", line \d+ in (\S+)')
_HOST_FILE = "controller/backends/host.py"


def default_poll_s(timeout_s: float) -> float:
    return min(10.0, max(0.05, timeout_s / 8))


@dataclass
class _Watched:
    group: str
    backend: Backend
    handles: list[Any]


@dataclass(frozen=True)
class _Stall:
    quiet_s: float  # seconds since the rank last beat
    group: str
    rank: int
    snap: dict[str, Any]


class HangWatchdog:
    """`with HangWatchdog(timeout_s, dump_dir):` watches the driver and every `WorkerGroup` built inside the block
    (they register themselves); see the module docstring. `timeout_s <= 0` is not allowed: don't build one."""

    def __init__(self, timeout_s: float, dump_dir: str | Path, *, poll_s: float | None = None,
                 exit_grace_s: float = 120.0,
                 on_unresponsive: Callable[[HangError], None] | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"HangWatchdog timeout_s={timeout_s} must be > 0 (trainer.hang_timeout_s: 0 or null "
                             f"turns the watchdog off; don't build one then)")
        self.timeout_s, self.dump_dir = float(timeout_s), Path(dump_dir)
        self.poll_s = poll_s if poll_s is not None else default_poll_s(self.timeout_s)
        self.exit_grace_s, self.on_unresponsive = exit_grace_s, on_unresponsive
        self.fired: HangError | None = None
        self._raised = False
        self._watched: list[_Watched] = []
        self._seen: dict[tuple[str, int], tuple[Any, float]] = {}  # (group, rank) -> (beats, when they last moved)
        self._last: dict[tuple[str, int], dict[str, Any]] = {}  # last answered snapshot
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the interrupt is never sent after the handler is gone
        self._thread: threading.Thread | None = None
        self._previous_handler: Any = None
        self._interruptible = False  # our handler is installed (the block runs in the main thread)

    # -------------------------------------------------------------------------------------------- watching
    def watch(self, group: str, backend: Backend, handles: Sequence[Any]) -> None:
        self._watched.append(_Watched(group, backend, list(handles)))

    def unwatch(self, handles: Sequence[Any]) -> None:
        gone = [w for w in self._watched if w.handles == list(handles)]
        self._watched = [w for w in self._watched if w not in gone]
        for w in gone:
            for key in [k for k in self._seen if k[0] == w.group]:
                self._seen.pop(key, None)
                self._last.pop(key, None)

    # ------------------------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> HangWatchdog:
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("a hang watchdog is already running in this process (one run at a time)")
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(INTERRUPT_SIGNAL, self._on_signal)
            self._interruptible = True
        else:
            logger.warning("hang watchdog: the run is not in the main thread, so a hang in the driver's own code or "
                           "an in-process worker is reported but cannot be interrupted")
        _ACTIVE = self
        self._thread = threading.Thread(target=self._run, name="hybridflow-hang-watchdog", daemon=True)
        self._thread.start()
        logger.info("hang watchdog: a stage without progress for %g s stops the run (stacks to %s)", self.timeout_s,
                    self.dump_dir)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        global _ACTIVE
        try:
            with self._lock:
                self._stop.set()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(timeout=max(5.0, 2 * self.poll_s))
        finally:  # the interrupt may land in here (a hang found as the block ended): leave nothing behind
            self._stop.set()  # also when the interrupt landed while the lock above was awaited
            if self._interruptible:
                # None: a handler installed outside Python, which cannot be restored from here
                signal.signal(INTERRUPT_SIGNAL, self._previous_handler if self._previous_handler is not None
                              else signal.SIG_DFL)
                self._interruptible = False
            _ACTIVE = None

    def raise_if_fired(self) -> None:
        """Raise the hang (once as found; a fresh copy for each later wait, e.g. a cleanup's call)."""
        err = self.fired
        if err is None:
            return
        if self._raised:
            raise HangError(err.stage, err.rank, err.group, err.method, err.timeout_s, err.dump_dir, err.detail)
        self._raised = True
        raise err

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.fired is not None:
            self.raise_if_fired()

    # ------------------------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                hang = self.poll()
            except Exception:  # the watchdog must outlive a failed read (a group shutting down under it)
                logger.exception("hang watchdog: reading progress failed; trying again in %g s", self.poll_s)
                continue
            if hang is not None:
                self._stop_main_thread(hang)
                return

    def poll(self, now: float | None = None) -> HangError | None:
        """Read every record once; on a hang, dump stacks, keep and return the `HangError` (the thread then stops
        the main thread)."""
        now = time.monotonic() if now is None else now
        driver = PROGRESS.snapshot()
        driver_stalled = self._stalled_for(_DRIVER, driver, now)
        stalls: list[_Stall] = []
        any_busy = False
        for w in list(self._watched):
            for rank, snap in enumerate(w.backend.progress(w.handles, timeout_s=self.poll_s)):
                key = (w.group, rank)
                stalled = self._stalled_for(key, snap, now)
                known = snap if snap is not None else self._last.get(key)
                if known is None or known.get("method") is None:
                    continue
                any_busy = True
                if stalled >= self.timeout_s:
                    # the rank quiet the longest by its own clock is the likeliest cause (the others often wait
                    # for it in a collective); an unanswered read counts from what the driver saw
                    quiet = snap["quiet_s"] if snap is not None else stalled
                    stalls.append(_Stall(quiet, w.group, rank, known))
        driver_hang = driver["stage"] is not None and not any_busy and driver_stalled >= self.timeout_s
        if not stalls and not driver_hang:
            return None
        stacks = self._stacks()
        if stalls:
            hang = self._blame(stalls, stacks, driver["stage"])
        else:
            hang = HangError(driver["stage"], -1, "", "", self.timeout_s, str(self.dump_dir))
        self._write(hang, driver, stacks)
        self.fired = hang
        logger.error("%s", hang)
        return hang

    def _blame(self, stalls: list[_Stall], stacks: dict[tuple[str, int], str], stage: str | None) -> HangError:
        """The likeliest cause among the ranks without progress: one not waiting inside a torch.distributed call
        (the others usually wait there for it), then the one quiet longest by its own clock, then the lowest."""
        waits = {(s.group, s.rank): collective_wait(stacks.get((s.group, s.rank), "")) for s in stalls}
        worst = min(stalls, key=lambda s: (waits[(s.group, s.rank)] is not None, -s.quiet_s))
        mb = worst.snap.get("micro_batch")
        detail = f", last micro-batch {mb}" if mb is not None else ""
        others = []
        for s in stalls:
            if s is not worst:
                wait = waits[(s.group, s.rank)]
                others.append(f"{s.group} rank {s.rank} in {s.snap['method']}"
                              + (f" (waiting in {wait})" if wait else ""))
        if others:
            detail += f"; also without progress: {', '.join(others)}"
        return HangError(stage or worst.snap["method"], worst.rank, worst.group, worst.snap["method"],
                         self.timeout_s, str(self.dump_dir), detail)

    def _stalled_for(self, key: tuple[str, int], snap: dict[str, Any] | None, now: float) -> float:
        """Seconds since `key`'s beats last moved (an unanswered read moves nothing)."""
        if snap is not None:
            self._last[key] = snap
        seen = self._seen.get(key)
        if seen is None or (snap is not None and snap["beats"] != seen[0]):
            self._seen[key] = (None if snap is None else snap["beats"], now)
            return 0.0
        return now - seen[1]

    def _stacks(self) -> dict[tuple[str, int], str]:
        """Every watched worker's Python stacks (all threads), by (group, rank)."""
        out: dict[tuple[str, int], str] = {}
        for w in list(self._watched):
            for rank, text in enumerate(w.backend.dump_stacks(w.handles, timeout_s=max(5.0, self.poll_s))):
                out[(w.group, rank)] = text
        return out

    def _write(self, hang: HangError, driver: dict[str, Any], stacks: dict[tuple[str, int], str]) -> None:
        """driver.txt (this process's stacks, taken now), `<group>.rank<r>.txt` per worker and progress.json."""
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        with open(self.dump_dir / "driver.txt", "w") as f:
            f.write(f"pid {os.getpid()} driver; {hang}\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        records: dict[str, Any] = {"hang": str(hang), "driver": driver}
        for (group, rank), text in stacks.items():
            name = f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', group)}.rank{rank}"
            (self.dump_dir / f"{name}.txt").write_text(text)
            records[name] = self._last.get((group, rank))
        (self.dump_dir / "progress.json").write_text(json.dumps(records, indent=1))

    def _stop_main_thread(self, hang: HangError) -> None:
        """Ray waits raise the hang within `poll_s`; a main thread stuck elsewhere gets the signal; a run still not
        ended `exit_grace_s` later (twice that once the error was raised: cleanups) is ended."""
        if self._stop.wait(2 * self.poll_s + 0.5):
            return
        with self._lock:
            if self._interruptible and not self._raised and not self._stop.is_set():
                signal.pthread_kill(threading.main_thread().ident or 0, INTERRUPT_SIGNAL)
        if self._stop.wait(self.exit_grace_s):
            return
        if self._raised and self._stop.wait(self.exit_grace_s):  # raised, still cleaning up: once more as long
            return
        logger.critical("hang watchdog: the run did not end %g s after the hang; ending the process (exit status "
                        "%d)", self.exit_grace_s, EXIT_CODE)
        if self.on_unresponsive is not None:
            try:
                self.on_unresponsive(hang)
            except Exception:  # the process ends next whatever happened here
                logger.exception("hang watchdog: recording the hang before exiting failed")
        os._exit(EXIT_CODE)
