"""Stage timers: `with timer("gen"):` records `timing/gen`; `timer.metrics()` returns them for the step. Each stage is
also a `stage/<name>` range in a torch profile (benchmarks/run.py names the stage behind each idle GPU gap), and the
driver's current stage for the hang watchdog (`hybridflow.controller.hang`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from hybridflow.utils.progress import in_stage


class StageTimer:
    """Wall-clock per named stage. Synchronises the GPU at stage ends so GPU work lands in its own stage."""

    def __init__(self, sync_cuda: bool | None = None) -> None:
        self._sync = torch.cuda.is_available() if sync_cuda is None else sync_cuda
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str, sync: bool = True) -> Iterator[None]:
        """`sync=False`: host work that runs while another thread's GPU stages are in flight (their kernels are not
        this stage's)."""
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"stage/{name}"), in_stage(name):
                yield
        finally:
            if self._sync and sync:
                torch.cuda.synchronize()
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        self.times[name] = self.times.get(name, 0.0) + seconds

    def metrics(self) -> dict[str, float]:
        return {f"timing/{k}": v for k, v in self.times.items()}
