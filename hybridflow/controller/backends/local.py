"""Local backend: one worker in the driver's own process (world size 1; no Ray, no extra processes).

Calls run eagerly at submit time; an exception is kept and raised by `wait`, so blocking and non-blocking calls
report errors the same way on both backends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hybridflow.controller.backends.base import Backend
from hybridflow.controller.backends.host import WorkerHost
from hybridflow.controller.errors import RemoteCallError, WorkerError
from hybridflow.controller.hang import active_timeout_s
from hybridflow.controller.resource_pool import ResourcePool
from hybridflow.controller.worker import Worker, WorkerEnv


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: RemoteCallError) -> None:
        self.error = error


class LocalBackend(Backend):
    kind = "local"

    def start(self, pool: ResourcePool, worker_cls: type[Worker], args: tuple[Any, ...], kwargs: dict[str, Any],
              group: str) -> list[Any]:
        if pool.world_size != 1:
            raise ValueError(f"worker group {group!r}: the local backend runs one in-process worker, but resource "
                             f"pool {pool.name!r} asks for {pool.world_size} processes "
                             f"(process_on_nodes={pool.process_on_nodes}); use backend='ray' (trainer.backend=ray) "
                             f"or a pool of one process")
        if pool.use_gpu and not torch.cuda.is_available():
            raise ValueError(f"worker group {group!r}: resource pool {pool.name!r} asks for a GPU (use_gpu=True, "
                             f"trainer.device=cuda) but torch sees none; use trainer.device=cpu or auto")
        host = WorkerHost()
        try:
            host.construct(WorkerEnv(hang_timeout_s=active_timeout_s()), (worker_cls, args, kwargs), export_env=False)
        except RemoteCallError as err:
            raise WorkerError(group, "__init__", 0, err.summary, err.traceback_text) from None
        pool.groups_placed += 1
        return [host]

    def submit(self, handles: Sequence[Any], ranks: Sequence[int], target: str,
               per_rank_args: Sequence[tuple[Any, ...]], per_rank_kwargs: Sequence[dict[str, Any]],
               concurrency_group: str | None = None) -> list[Any]:
        out: list[Any] = []  # every call runs now, to completion: a concurrency group changes nothing
        for rank, args, kwargs in zip(ranks, per_rank_args, per_rank_kwargs):
            try:
                out.append(handles[rank].call(target, *args, **kwargs))
            except RemoteCallError as err:
                out.append(_Failed(err))
        return out

    def wait(self, refs: Sequence[Any], ranks: Sequence[int], group: str, method: str,
             timeout_s: float | None) -> list[Any]:
        for rank, ref in zip(ranks, refs):
            if isinstance(ref, _Failed):
                raise WorkerError(group, method, rank, ref.error.summary, ref.error.traceback_text)
        return list(refs)

    def ready(self, refs: Sequence[Any]) -> bool:
        return True

    def progress(self, handles: Sequence[Any], timeout_s: float) -> list[dict[str, Any] | None]:
        return [host.progress() for host in handles]  # the driver's own record: the worker runs in this process

    def dump_stacks(self, handles: Sequence[Any], timeout_s: float) -> list[str]:
        return [host.dump_stacks() for host in handles]

    def stop(self, handles: Sequence[Any], pool: ResourcePool) -> None:
        for host in handles:
            host.worker = None
        pool.groups_placed = max(0, pool.groups_placed - 1)
