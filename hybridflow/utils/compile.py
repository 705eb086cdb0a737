"""`torch.compile` with a one-time eager fallback."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


class GuardedCompile:
    """`torch.compile(fn, dynamic=dynamic)`, compiled at the first call; on its first failure (Dynamo, Inductor or
    the kernel launch) it logs why and runs `fn` eagerly for the rest of the process — never retried, so a broken
    compiler costs one attempt, not one per call. `dynamic`: True (default) compiles every dimension symbolic
    once; None specialises on the first shapes and makes dynamic only the dimensions that change later."""

    def __init__(self, fn: Callable, what: str, dynamic: bool | None = True) -> None:
        self.fn, self.what, self.dynamic = fn, what, dynamic
        self.compiled: Callable | None = None
        self.failed = False

    def __call__(self, *args, **kwargs):
        if not self.failed:
            try:
                if self.compiled is None:
                    self.compiled = torch.compile(self.fn, dynamic=self.dynamic)
                return self.compiled(*args, **kwargs)
            except torch.OutOfMemoryError:
                raise  # out of memory is the workload's, not the compiler's: eager would not fit either
            except Exception as err:  # noqa: BLE001 — Dynamo/Inductor/Triton raise many unrelated types
                logger.warning("torch.compile of %s failed (%s: %s); it runs eagerly from now on",
                               self.what, type(err).__name__, str(err).splitlines()[0] if str(err) else "")
                self.failed, self.compiled = True, None
        return self.fn(*args, **kwargs)

    @property
    def ok(self) -> bool:
        return not self.failed
