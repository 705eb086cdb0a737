"""This process's progress record, read by the hang watchdog (`hybridflow.controller.hang`).

Writers only set dict entries and bump a counter (no locks, no I/O, no device syncs), so the happy path costs
nothing measurable: the worker host marks each registered call, the driver's stage timer marks each stage, and the
engines `beat()` once per micro-batch or decode step. Calls and stages are kept per thread (a Ray actor's concurrency
groups and the async driver's threads run them side by side). A lost increment under a thread race is harmless: the
watchdog only asks whether the counter moved.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

_MAIN = threading.main_thread().ident


class Progress:
    """What this process is doing (`stages` on the driver, `methods` in worker calls, each by thread id) and
    `beats`, a counter that moves whenever it makes progress."""

    __slots__ = ("stages", "methods", "micro_batch", "beats", "since", "last")

    def __init__(self) -> None:
        self.stages: dict[int, str] = {}
        self.methods: dict[int, str] = {}
        self.micro_batch: int | None = None
        self.beats = 0
        self.since = self.last = time.monotonic()  # when the latest call (or stage) began; the last beat

    def snapshot(self) -> dict[str, Any]:
        """`stage`: the main thread's, else the oldest; `method`: the oldest call running (None: idle)."""
        now = time.monotonic()
        stages, methods = dict(self.stages), dict(self.methods)
        stage = stages.get(_MAIN) or next(iter(stages.values()), None)
        method = next(iter(methods.values()), None)
        return {"stage": stage, "method": method, "micro_batch": self.micro_batch, "beats": self.beats,
                "busy_s": round(now - self.since, 3) if (method or stage) else 0.0,
                "quiet_s": round(now - self.last, 3)}


PROGRESS = Progress()


def beat(micro_batch: int | None = None) -> None:
    """Progress inside a long call (one micro-batch, one decode step)."""
    p = PROGRESS
    p.beats, p.last = p.beats + 1, time.monotonic()
    if micro_batch is not None:
        p.micro_batch = micro_batch


@contextlib.contextmanager
def _marked(table: dict[int, str], name: str, *, new_call: bool) -> Iterator[None]:
    p, me = PROGRESS, threading.get_ident()
    outer = table.get(me)
    if outer is not None:
        del table[me]  # re-inserted last: the dict's order stays "oldest first"
    table[me] = name
    p.beats, p.last = p.beats + 1, time.monotonic()
    if new_call:
        p.micro_batch = None
    if new_call or not p.methods:
        p.since = p.last
    try:
        yield
    finally:
        if outer is None:
            table.pop(me, None)
        else:
            table[me] = outer
        p.beats, p.last = p.beats + 1, time.monotonic()


def in_stage(name: str) -> contextlib.AbstractContextManager[None]:
    """The driver is in stage `name` on this thread (nested stages restore the outer one)."""
    return _marked(PROGRESS.stages, name, new_call=False)


def current_stage() -> str:
    """The driver stage this thread is in (the main thread's when this one has none); "" outside any stage."""
    stages = PROGRESS.stages
    return stages.get(threading.get_ident()) or stages.get(_MAIN) or ""


def in_method(name: str) -> contextlib.AbstractContextManager[None]:
    """A worker runs its method `name` on this thread (the worker host marks every driver call)."""
    return _marked(PROGRESS.methods, name, new_call=True)
