"""This process's progress record, read by the hang watchdog (`hybridflow.controller.hang`).

Writers only set attributes and bump a counter (no locks, no I/O, no device syncs), so the happy path costs
nothing measurable: the worker host marks each registered call, the driver's stage timer marks each stage, and the
engines `beat()` once per micro-batch or decode step. A lost increment under a thread race is harmless: the
watchdog only asks whether the counter moved.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any


class Progress:
    """What this process is doing (`stage` on the driver, `method` in a worker call) and `beats`, a counter that
    moves whenever it makes progress."""

    __slots__ = ("stage", "method", "micro_batch", "beats", "since", "last")

    def __init__(self) -> None:
        self.stage: str | None = None
        self.method: str | None = None
        self.micro_batch: int | None = None
        self.beats = 0
        self.since = self.last = time.monotonic()  # when `method` (or else `stage`) began; the last beat

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        busy_s = now - self.since if (self.method or self.stage) else 0.0
        return {"stage": self.stage, "method": self.method, "micro_batch": self.micro_batch, "beats": self.beats,
                "busy_s": round(busy_s, 3), "quiet_s": round(now - self.last, 3)}


PROGRESS = Progress()


def beat(micro_batch: int | None = None) -> None:
    """Progress inside a long call (one micro-batch, one decode step)."""
    p = PROGRESS
    p.beats, p.last = p.beats + 1, time.monotonic()
    if micro_batch is not None:
        p.micro_batch = micro_batch


@contextlib.contextmanager
def in_stage(name: str) -> Iterator[None]:
    """The driver is in stage `name` (nested stages restore the outer one)."""
    p = PROGRESS
    outer = p.stage
    p.stage, p.beats, p.last = name, p.beats + 1, time.monotonic()
    if p.method is None:
        p.since = p.last
    try:
        yield
    finally:
        p.stage, p.beats, p.last = outer, p.beats + 1, time.monotonic()


@contextlib.contextmanager
def in_method(name: str) -> Iterator[None]:
    """A worker runs its method `name` (called by the worker host around every driver call)."""
    p = PROGRESS
    outer = p.method
    p.method, p.micro_batch, p.beats = name, None, p.beats + 1
    p.since = p.last = time.monotonic()
    try:
        yield
    finally:
        p.method, p.beats, p.last = outer, p.beats + 1, time.monotonic()
