"""Run scorers safely: `ScoringPool` (worker processes, hard per-item timeout) and `InlineScorer` (in-process).

Design: `concurrent.futures` cannot stop a hung call, so the pool is our own. Each worker receives a chunk of
items, publishes (current item, start time) in shared memory and sends results back in batches; a worker whose
current item runs past `timeout_s` is killed (SIGKILL) and replaced, that item counted as a timeout and the
chunk's unreported items re-queued. A worker that dies (segfault, OOM kill) costs only its current item.
Workers are forked once and kept between calls.
`InlineScorer` (reward.num_workers=0) enforces the timeout with SIGALRM on the main thread: best effort (pure
Python loops and sleeps are interrupted; a C call that never returns is not).
"""

from __future__ import annotations

import collections
import logging
import math
import multiprocessing as mp
import numbers
import signal
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from hybridflow.rewards.custom import Spec, resolve

logger = logging.getLogger(__name__)

# (scorer spec, data_source, solution_str, ground_truth, extra_info)
Item = tuple[Spec, str, str, Any, Any]


@dataclass
class ItemResult:
    status: str  # ok | error | timeout
    score: float = math.nan
    extras: dict[str, Any] = field(default_factory=dict)
    error: str = ""  # traceback or reason
    kind: str = ""  # what went wrong, for logging once per kind: "raised ValueError", "returned str", ...


class InvalidReward(TypeError):
    """A scorer returned something that is not a reward; `kind` names what it returned."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def to_score(out: Any) -> tuple[float, dict[str, Any]]:
    """A scorer's return value → (score, extras). Accepted: an int/float (a bool counts as 0/1) or a dict with
    such a `score`; anything else (a "0.75" string, None, a tensor) raises InvalidReward."""
    extras: dict[str, Any] = {}
    value, what, kind = out, "a value", "returned {}"
    if isinstance(out, dict):
        if "score" not in out:
            raise InvalidReward(f"returned a dict without 'score' (keys {sorted(map(str, out))})", "dict without score")
        # Plain values only: anything else could fail to pickle on the way back from a worker.
        extras = {k: v for k, v in out.items() if k != "score" and isinstance(v, int | float | str | None)}
        value, what, kind = out["score"], "a dict whose 'score' is", "returned a dict with a {} score"
    if isinstance(value, bool | np.bool_ | numbers.Real):
        return float(value), extras
    name = type(value).__name__
    raise InvalidReward(f"returned {what} of type {name} ({value!r:.60}); a reward must be an int/float or a dict "
                        "with a numeric 'score' (convert it in the scorer, e.g. float(x))", kind.format(name))


def score_one(item: Item) -> ItemResult:
    """Call the scorer; an exception, a non-number or NaN/inf becomes an `error` result (never raises)."""
    spec, data_source, solution, ground_truth, extra_info = item
    try:
        score, extras = to_score(resolve(spec)(data_source, solution, ground_truth, extra_info))
    except InvalidReward as err:
        return ItemResult("error", error=f"scorer {spec} {err}", kind=err.kind)
    except Exception as err:  # noqa: BLE001 — a user scorer may raise anything; it becomes a counted error
        return ItemResult("error", error=traceback.format_exc(), kind=f"raised {type(err).__name__}")
    if not math.isfinite(score):
        return ItemResult("error", error=f"scorer {spec} returned a non-finite score {score!r}", kind="non-finite")
    return ItemResult("ok", score, extras)


FLUSH_S = 0.2  # a worker sends finished results at least this often, so a kill loses little finished work


def _worker_main(conn: Connection, progress: Any) -> None:
    """Score chunks; `progress` = [index of the item being scored, its start time] in shared memory."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the driver, which closes the pool
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        done, last_flush = [], time.monotonic()
        for idx, item in msg:
            progress[1] = time.monotonic()
            progress[0] = idx
            done.append((idx, score_one(item)))
            if time.monotonic() - last_flush > FLUSH_S:
                conn.send(done)
                done, last_flush = [], time.monotonic()
        if done:
            conn.send(done)


class _Worker:
    def __init__(self, ctx: Any) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.progress = ctx.Array("d", [-1.0, 0.0], lock=False)
        self.proc = ctx.Process(target=_worker_main, args=(child, self.progress), daemon=True,
                                name="hybridflow-reward")
        self.proc.start()
        child.close()
        self.todo: dict[int, Item] = {}  # sent, result not yet received (insertion = scoring order)

    def send(self, chunk: list[tuple[int, Item]]) -> None:
        self.todo.update(chunk)
        self.progress[1], self.progress[0] = time.monotonic(), float(chunk[0][0])
        self.conn.send(chunk)

    def current(self) -> int:
        """The item being scored (falls back to the first outstanding one)."""
        idx = int(self.progress[0])
        return idx if idx in self.todo else next(iter(self.todo))

    def deadline(self, timeout_s: float) -> float:
        return self.progress[1] + timeout_s

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class ScoringPool:
    """`num_workers` scorer processes kept alive between `run` calls; `close()` stops them.

    Results come back per chunk (not per item: the IPC would cost more than a rule scorer); per-item progress
    is read from shared memory, so a timeout is still charged to the item that hung.
    """

    def __init__(self, num_workers: int, timeout_s: float, mp_context: str = "fork") -> None:
        if num_workers < 1:
            raise ValueError(f"reward.num_workers={num_workers}: ScoringPool needs >= 1 (0 = InlineScorer)")
        self.timeout_s = timeout_s
        self._ctx = mp.get_context(mp_context)
        self._workers = [_Worker(self._ctx) for _ in range(num_workers)]
        self.restarts = 0

    def run(self, items: Sequence[Item]) -> list[ItemResult]:
        if not self._workers:
            raise RuntimeError("ScoringPool is closed")
        results: list[ItemResult | None] = [None] * len(items)
        size = max(1, min(64, math.ceil(len(items) / (4 * len(self._workers)))))
        queue = collections.deque(list(enumerate(items))[i:i + size] for i in range(0, len(items), size))
        while queue or any(w.todo for w in self._workers):
            for w in self._workers:
                if not w.todo and queue:
                    w.send(queue.popleft())
            busy = [w for w in self._workers if w.todo]
            wait_s = min(w.deadline(self.timeout_s) for w in busy) - time.monotonic()
            ready = wait([w.conn for w in busy], timeout=max(0.0, wait_s))
            for i, w in enumerate(list(self._workers)):
                if not w.todo:
                    continue
                if w.conn in ready:
                    try:
                        for idx, res in w.conn.recv():
                            results[idx] = res
                            del w.todo[idx]
                    except (EOFError, OSError):
                        self._fail(i, queue, results, "error", f"reward worker died (exit code {w.proc.exitcode})")
                elif time.monotonic() >= w.deadline(self.timeout_s):
                    self._fail(i, queue, results, "timeout", f"scorer exceeded reward.timeout_s={self.timeout_s}")
        return results  # type: ignore[return-value]

    def _fail(self, i: int, queue: collections.deque, results: list, status: str, reason: str) -> None:
        """Charge worker i's current item, re-queue its other unreported items, replace the worker."""
        w = self._workers[i]
        idx = w.current()
        results[idx] = ItemResult(status, error=reason, kind=status if status == "timeout" else "worker died")
        del w.todo[idx]
        if w.todo:
            queue.appendleft(list(w.todo.items()))
        w.todo.clear()
        w.kill()
        self._workers[i] = _Worker(self._ctx)
        self.restarts += 1

    def close(self) -> None:
        for w in self._workers:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass  # already dead; kill() below reaps it
        for w in self._workers:
            w.proc.join(timeout=1)
            w.kill()
        self._workers = []


class _AlarmTimeout(BaseException):
    """BaseException so that a scorer's `except Exception` cannot swallow the timeout."""


class InlineScorer:
    """Scores in the calling process; SIGALRM timeout when on the main thread (see module docstring)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.restarts = 0

    def run(self, items: Sequence[Item]) -> list[ItemResult]:
        if threading.current_thread() is not threading.main_thread():
            return [score_one(item) for item in items]
        return [self._timed(item) for item in items]

    def _timed(self, item: Item) -> ItemResult:
        def on_alarm(signum: int, frame: Any) -> None:
            raise _AlarmTimeout

        previous = signal.signal(signal.SIGALRM, on_alarm)
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, self.timeout_s)
                return score_one(item)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _AlarmTimeout:  # also when the alarm lands just after the scorer returned: safe either way
            return ItemResult("timeout", error=f"scorer exceeded reward.timeout_s={self.timeout_s}", kind="timeout")
        finally:
            signal.signal(signal.SIGALRM, previous)

    def close(self) -> None:
        """Nothing to release."""
