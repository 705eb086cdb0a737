"""Graceful stop: the first SIGINT (Ctrl-C) or SIGTERM asks the training loop to stop after the step in flight; the
loop saves a checkpoint and raises `Interrupted`, whose message says how to resume. A second signal stops at once.

Why not raise from the handler as Python does by default: an exception thrown into the middle of a step lands in a
worker call, an optimizer step or a checkpoint write, and the progress since the last save is lost; finishing the
step costs one step's time and keeps everything (in `one_step_off` / `async` modes the save also waits for the
rollouts in flight, which the checkpoint keeps: up to `max_staleness + 1` batches of generation).
`run_cleanups` / `cleaned_up`: what runs on the way out (the last save, the workers), every step even after one
fails.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The run stopped on a signal (recorded as `interrupted`). `exit_code` is the shell's 128 + signal number
    (130 for Ctrl-C, 143 for SIGTERM); the message says what was saved and how to resume."""

    def __init__(self, message: str, signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.signum = int(signum)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def exit_code(error: KeyboardInterrupt) -> int:
    """The process exit code for an interrupt: the signal's for `Interrupted`, 130 (Ctrl-C) otherwise."""
    return error.exit_code if isinstance(error, Interrupted) else 128 + signal.SIGINT


class StopRequest:
    """Set by the first stop signal; the loop reads `requested` between steps."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "none"

    def request(self, signum: int) -> None:
        """What the first signal does (tests call it to stop a run without sending a signal)."""
        self.signum = int(signum)


@contextlib.contextmanager
def graceful_stop() -> Iterator[StopRequest]:
    """Within the block the first SIGINT/SIGTERM sets the returned request; a second raises `Interrupted` where the
    program is. Outside the main thread no handler can be installed: the request is then never set by a signal."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def on_signal(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if stop.requested:
            raise Interrupted(f"{name} received again while stopping: stopped at once, without saving", signum)
        stop.request(signum)
        logger.warning("%s received: stopping after the current step and saving a checkpoint (send it again to stop "
                       "at once, without saving)", name)

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def signals_deferred(what: str) -> Iterator[None]:
    """Within the block (closing a run: waiting for the last checkpoint write, releasing workers) a SIGINT/SIGTERM is
    logged, not raised: an exception thrown into that wait left a half-written checkpoint and, with the writer thread
    still running, the interpreter aborted at exit. The process ends as soon as the block is done anyway."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, frame: FrameType | None) -> None:
        logger.warning("%s received while %s: finishing that first", signal.Signals(signum).name, what)

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ------------------------------------------------------------------------------------------------------ cleanups
def run_cleanups(cleanups: Sequence[Callable[[], Any]], error: BaseException | None = None) -> None:
    """Call every cleanup, even after one fails. With `error` in flight, each failure becomes a note on `error`
    (and a log line) and nothing is raised here: the caller re-raises `error`. Without, the first failure is
    raised once all ran, later ones attached to it as notes."""
    first: BaseException | None = None
    for cleanup in cleanups:
        try:
            cleanup()
        except Exception as err:
            name = getattr(cleanup, "__qualname__", repr(cleanup))
            if error is not None:
                logger.error("cleanup %s failed after the run had failed: %s: %s", name, type(err).__name__, err)
                error.add_note(f"cleanup {name} also failed: {type(err).__name__}: {err}")
            elif first is None:
                first = err
            else:
                first.add_note(f"cleanup {name} also failed: {type(err).__name__}: {err}")
    if first is not None:
        raise first


@contextlib.contextmanager
def cleaned_up(*cleanups: Callable[[], Any]) -> Iterator[None]:
    """Run `cleanups` when the block ends; an error of the block stays the one raised (see `run_cleanups`)."""
    try:
        yield
    except BaseException as err:
        run_cleanups(cleanups, err)
        raise
    run_cleanups(cleanups)
