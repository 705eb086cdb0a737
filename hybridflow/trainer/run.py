"""Run a training from a config and close it honestly: the one place every trainer (PPO, SFT, RM) opens its tracker,
turns SIGTERM into an interrupt, runs cleanups without letting them hide the failure, and writes `run_end`.

`run_end` says `finished | failed | interrupted` with the error's type and message (and the worker group, method
and rank of a worker's failure). A cleanup that fails while a failure is in flight (closing checkpoints on a dead
Ray group) is attached to the original error as a note and logged; the original is the error the user sees. With
`trainer.hang_timeout_s` > 0 a hang watchdog (`controller.hang`) watches the run: a stage without progress dumps
every rank's stacks to `<run_dir>/hang/` and fails the run with `HangError`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from hybridflow.config import Config
from hybridflow.tracking import Tracker
from hybridflow.tracking.run_info import collect_versions, summary
from hybridflow.trainer.stop import Interrupted, cleaned_up, run_cleanups

if TYPE_CHECKING:
    from hybridflow.tracking import Tracker

logger = logging.getLogger(__name__)


class Terminated(Interrupted):
    """SIGTERM arrived outside the training loop (while loading, validating before training, closing): raised in
    the main thread so cleanups and `run_end` run; recorded as `interrupted`, exit code 143. Inside the loop the
    first SIGTERM stops after the step with a checkpoint instead (`hybridflow.trainer.stop`)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, signal.SIGTERM)


def versions_line() -> str:
    """python, torch, CUDA, transformers, ray, hybridflow and the device, on one line (the seed's advice)."""

    return summary(collect_versions())


# ------------------------------------------------------------------------------------------------------- signals
@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises `Terminated` in the main thread (by default it kills the process before any
    `finally` runs). Other threads cannot install handlers: there the block changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum: int, frame: FrameType | None) -> None:
        raise Terminated(f"signal {signal.Signals(signum).name} received")

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---------------------------------------------------------------------------------------------------------- runs
@contextlib.contextmanager
def tracked_run(cfg: Config, tracker: Tracker | None = None) -> Iterator[Tracker]:
    """The run's tracker (built from `trainer.logger` when not given). A tracker built here is closed here with
    the run's honest status, and its run directories are claimed for the run (`trainer/run_dir.py`: a lock, and no
    fresh run into another run's directory); a given one belongs to the caller (close it with
    `tracker.close(error=...)`)."""
    own = tracker is None
    with contextlib.ExitStack() as stack:
        if own:
            from hybridflow.trainer.run_dir import claimed_run_dirs

            stack.enter_context(claimed_run_dirs(cfg))
            tracker = Tracker.from_config(cfg)
        assert tracker is not None
        with sigterm_as_interrupt(), hang_watchdog(cfg, tracker):
            try:
                yield tracker
            except BaseException as err:
                if own:  # a failing close is a note on the run's own error, never the error raised
                    run_cleanups([functools.partial(tracker.close, error=err)], err)
                raise
        if own:
            tracker.close()


@contextlib.contextmanager
def hang_watchdog(cfg: Config, tracker: Tracker | None = None) -> Iterator[None]:
    """Watch the block for hangs when `trainer.hang_timeout_s` > 0 (stacks go to `<run_dir>/hang/`). `tracker`
    (the run's, built here or by the command) records `run_end` if the watchdog has to end a process whose main
    thread is stuck."""
    from hybridflow.controller.hang import HangWatchdog, active_watchdog

    timeout_s = cfg.trainer.hang_timeout_s
    if not timeout_s or active_watchdog() is not None:  # off, or a run inside a run: the outer watchdog watches
        yield
        return

    on_unresponsive = None if tracker is None else (lambda err: tracker.close(error=err))
    with HangWatchdog(timeout_s, Path(cfg.trainer.run_dir) / "hang", on_unresponsive=on_unresponsive):
        yield


def run_ppo(cfg: Config, tracker: Tracker | None = None) -> list[dict[str, float]]:
    """Train with `cfg`; returns the per-step metrics. The tracker is built from `trainer.logger` when not given."""
    from hybridflow.trainer.ppo import PPOTrainer

    with tracked_run(cfg, tracker) as tracker:
        trainer = PPOTrainer(cfg, tracker=tracker)
        with cleaned_up(trainer.close):
            return trainer.fit()
