"""`Backend`: the few operations a `WorkerGroup` needs from a way of running workers (in-process or Ray).

Handles and references are opaque to the group: the local backend returns plain values, Ray returns ObjectRefs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from hybridflow.controller.resource_pool import ResourcePool
from hybridflow.controller.worker import Worker


class Backend(ABC):
    kind: str = ""

    @abstractmethod
    def start(self, pool: ResourcePool, worker_cls: type[Worker], args: tuple[Any, ...], kwargs: dict[str, Any],
              group: str) -> list[Any]:
        """Start one worker per rank of `pool`; returns one handle per rank (rank order)."""

    @abstractmethod
    def submit(self, handles: Sequence[Any], ranks: Sequence[int], target: str,
               per_rank_args: Sequence[tuple[Any, ...]], per_rank_kwargs: Sequence[dict[str, Any]],
               concurrency_group: str | None = None) -> list[Any]:
        """Call `target` on each of `ranks` without waiting; one reference per rank. `concurrency_group`: the
        actor's thread group to run it in (backends without concurrent calls ignore it)."""

    @abstractmethod
    def wait(self, refs: Sequence[Any], ranks: Sequence[int], group: str, method: str,
             timeout_s: float | None) -> list[Any]:
        """Values of `refs`; raises `WorkerError` (naming the rank) or `WorkerTimeoutError` as soon as known."""

    @abstractmethod
    def ready(self, refs: Sequence[Any]) -> bool:
        """True when every reference has finished; never blocks."""

    @abstractmethod
    def progress(self, handles: Sequence[Any], timeout_s: float) -> list[dict[str, Any] | None]:
        """Each worker's progress record (`WorkerHost.progress`), read while calls run; None for a worker that did
        not answer within `timeout_s` (dead, or stuck holding the GIL)."""

    @abstractmethod
    def dump_stacks(self, handles: Sequence[Any], timeout_s: float) -> list[str]:
        """Each worker's Python stacks (all threads), or a line saying why they could not be read."""

    @abstractmethod
    def stop(self, handles: Sequence[Any], pool: ResourcePool) -> None:
        """Stop the workers; the pool's allocation stays until `pool.release()`."""
