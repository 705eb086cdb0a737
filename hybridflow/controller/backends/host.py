"""`WorkerHost`: the object that owns one worker instance and runs the driver's calls on it.

The local backend uses it in-process; the Ray backend wraps it as an actor (one per rank). It turns a worker's
exception into a `RemoteCallError` carrying the rank and the formatted traceback, and resolves `RemoteSlice`
arguments (chunks of a previous call's output fetched worker-side).
"""

from __future__ import annotations

import faulthandler
import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

from hybridflow.controller.errors import HangError, RemoteCallError
from hybridflow.controller.futures import RemoteSlice
from hybridflow.controller.worker import WORKER_BASE_ENV, Worker, WorkerEnv, find_free_port, worker_env
from hybridflow.utils.progress import PROGRESS, in_method


class WorkerHost:
    """Holds one worker; `call(target, *args, **kwargs)` runs `worker.target(...)`."""

    # In the driver's own process a KeyboardInterrupt is the user's stop, raised as it is; in a worker process it
    # is that worker's failure, reported as one.
    in_driver_process = True

    def __init__(self, fetch: Callable[[list[Any]], list[Any]] | None = None) -> None:
        self.worker: Worker | None = None
        self.rank = 0
        self._fetch = fetch  # how a RemoteSlice gets its refs (ray.get in a Ray actor)

    def node_address(self) -> tuple[str, int]:
        """(IP other nodes can reach this one at, a free port here): the rendezvous point when this is rank 0."""
        try:
            import ray

            ip = ray.util.get_node_ip_address()
        except ImportError:
            ip = socket.gethostbyname(socket.gethostname())
        return ip, find_free_port()

    def construct(self, env: WorkerEnv, payload: tuple[type[Worker], tuple[Any, ...], dict[str, Any]],
                  export_env: bool) -> int:
        """Build `cls(*args, **kwargs)` from `payload`. `export_env` also writes RANK/WORLD_SIZE/... into
        os.environ (only for a process that hosts this one worker)."""
        worker_cls, args, kwargs = payload
        self.rank = env.rank
        if export_env:
            os.environ.update(WORKER_BASE_ENV)
            os.environ.update(env.to_env_vars())
        try:
            with worker_env(env):
                self.worker = worker_cls(*args, **kwargs)
        except BaseException as exc:
            raise self._wrap(exc) from None
        return os.getpid()

    def call(self, target: str, *args: Any, **kwargs: Any) -> Any:
        try:
            with in_method(target):
                if self._fetch is not None:
                    args, kwargs = self._resolve(args, kwargs)
                return getattr(self.worker, target)(*args, **kwargs)
        except HangError:  # the driver's watchdog interrupted an in-process call: the run stops with it
            raise
        except KeyboardInterrupt as exc:
            if self.in_driver_process:
                raise
            raise self._wrap(exc) from None
        except BaseException as exc:
            raise self._wrap(exc) from None

    # The hang watchdog's two questions; a Ray actor answers them on its own thread while a call runs.
    def progress(self) -> dict[str, Any]:
        """This process's progress record (what it runs, and a counter that moves while it makes progress)."""
        return PROGRESS.snapshot()

    def dump_stacks(self) -> str:
        """Every thread's Python stack in this process (faulthandler's text: works while another thread is stuck)."""
        with tempfile.TemporaryFile(mode="w+") as f:
            faulthandler.dump_traceback(f, all_threads=True)
            f.seek(0)
            return f"pid {os.getpid()} rank {self.rank}\n" + f.read()

    def _resolve(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        fetch = self._fetch
        assert fetch is not None
        if any(isinstance(a, RemoteSlice) for a in args):
            args = tuple(a.resolve(fetch) if isinstance(a, RemoteSlice) else a for a in args)
        if any(isinstance(v, RemoteSlice) for v in kwargs.values()):
            kwargs = {k: v.resolve(fetch) if isinstance(v, RemoteSlice) else v for k, v in kwargs.items()}
        return args, kwargs

    def _wrap(self, exc: BaseException) -> RemoteCallError:
        if isinstance(exc, RemoteCallError):
            return exc
        summary = f"{type(exc).__name__}: {exc}"
        return RemoteCallError(self.rank, summary, "".join(traceback.format_exception(exc)))
