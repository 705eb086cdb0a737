"""`Worker`: the base class of every role process (actor/rollout, critic, reference, reward model).

A worker learns its place (rank, world size, local rank, device, rendezvous address) from a `WorkerEnv` that the
backend provides: environment variables in a Ray actor, a context variable for the in-process local backend.
`init_distributed()` is idempotent; world size 1 uses an in-memory store (no port) so it costs ~nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.controller.hang import collective_timeout_s

logger = logging.getLogger(__name__)

# Always set in worker processes: NVLink multicast (NVLS) hangs or fails on the shared H200 hosts.
WORKER_BASE_ENV: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def worker_base_env() -> dict[str, str]:
    """What every worker process gets: WORKER_BASE_ENV plus the driver's own `HYBRIDFLOW_*` settings (e.g.
    HYBRIDFLOW_FP8_GEMM, read where the rollout engine is built): a Ray cluster's workers start from the raylet's
    environment, not the driver's, so a variable exported before `hybridflow train` would not reach them."""
    return {**WORKER_BASE_ENV, **{k: v for k, v in os.environ.items() if k.startswith("HYBRIDFLOW_")}}


@dataclass(frozen=True)
class WorkerEnv:
    """Where a worker sits in its group; `master_port == 0` means "no rendezvous needed" (world size 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    hang_timeout_s: float = 0.0  # the run's trainer.hang_timeout_s (0 = off): collective timeouts derive from it

    def to_env_vars(self) -> dict[str, str]:
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "HYBRIDFLOW_HANG_TIMEOUT_S": str(self.hang_timeout_s),
        }

    @staticmethod
    def from_env_vars(env: os._Environ[str] | dict[str, str] = os.environ) -> WorkerEnv:
        return WorkerEnv(
            rank=int(env.get("RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 0)),
            hang_timeout_s=float(env.get("HYBRIDFLOW_HANG_TIMEOUT_S", 0.0)),
        )


_CURRENT_ENV: contextvars.ContextVar[WorkerEnv | None] = contextvars.ContextVar("hybridflow_worker_env", default=None)


@contextlib.contextmanager
def worker_env(env: WorkerEnv) -> Iterator[None]:
    """Workers constructed inside this block see `env` (used by in-process backends instead of os.environ)."""
    token = _CURRENT_ENV.set(env)
    try:
        yield
    finally:
        _CURRENT_ENV.reset(token)


def current_worker_env() -> WorkerEnv:
    env = _CURRENT_ENV.get()
    return env if env is not None else WorkerEnv.from_env_vars()


def find_free_port(host: str = "") -> int:
    """A TCP port free right now on this host (the OS picks it; tiny race window before it is bound again)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class DispatchInfo:
    """How the driver splits data for this worker: which data-parallel chunk it gets, and whether its output
    is gathered (tensor/sequence-parallel peers share a dp_rank; exactly one of them has is_collect=True)."""

    dp_rank: int
    dp_size: int
    is_collect: bool


class Worker:
    """Base class for role workers. Subclasses call `super().__init__()` first and decorate the methods the
    driver may call with `@register(...)`."""

    def __init__(self) -> None:
        self._worker_env = current_worker_env()
        self._dispatch_info = DispatchInfo(self._worker_env.rank, self._worker_env.world_size, True)
        if torch.cuda.is_available():
            # Ray leaves one visible GPU per actor (index 0); torchrun-style launches see all of them.
            index = self._worker_env.local_rank if torch.cuda.device_count() > self._worker_env.local_rank else 0
            self._device = torch.device("cuda", index)
        else:
            self._device = torch.device("cpu")

    @classmethod
    def concurrency_groups(cls, *args: Any, **kwargs: Any) -> dict[str, int]:
        """Named thread groups (name → threads) the Ray actor gets beside its default group, given the worker's
        constructor arguments; a method registered with `concurrency_group=name` runs there, concurrently with the
        default group's calls (which still run one at a time, in order). None by default."""
        return {}

    # ------------------------------------------------------------------------------------------ placement
    @property
    def rank(self) -> int:
        return self._worker_env.rank

    @property
    def world_size(self) -> int:
        return self._worker_env.world_size

    @property
    def local_rank(self) -> int:
        return self._worker_env.local_rank

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def worker_env(self) -> WorkerEnv:
        return self._worker_env

    # ------------------------------------------------------------------------------------------- dispatch
    def set_dispatch_info(self, dp_rank: int, dp_size: int, is_collect: bool = True) -> None:
        """Declare this rank's data-parallel chunk and whether the driver gathers its output.

        Call it before the first data-parallel call (e.g. in `__init__` or an init method); a driver that
        already cached the layout must call `worker_group.refresh_dispatch_info()`.
        """
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"set_dispatch_info: dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        self._dispatch_info = DispatchInfo(dp_rank, dp_size, is_collect)

    def get_dispatch_info(self) -> DispatchInfo:
        return self._dispatch_info

    # ---------------------------------------------------------------------------------------- distributed
    def init_distributed(self, backend: str | None = None, timeout_s: float | None = None) -> None:
        """Join this group's default process group (gloo on CPU, nccl on GPU). Safe to call more than once.
        `timeout_s` (collectives): by default a little over the run's hang timeout (`collective_timeout_s`)."""
        env = self._worker_env
        if dist.is_initialized():
            if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
                raise RuntimeError(
                    f"torch.distributed is already initialised with rank {dist.get_rank()}/{dist.get_world_size()} "
                    f"but this worker is rank {env.rank}/{env.world_size}; one process can host one group only")
            return
        backend = backend or ("nccl" if self._device.type == "cuda" else "gloo")
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        device_id = self._device if backend == "nccl" else None
        if timeout_s is None:
            timeout_s = collective_timeout_s(env.hang_timeout_s)
        timeout = timedelta(seconds=timeout_s)
        if env.world_size == 1 and env.master_port == 0:
            # FSDP2 needs a process group even for one rank; an in-memory store avoids picking a port.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
                                    device_id=device_id)
        else:
            dist.init_process_group(backend, init_method=f"tcp://{env.master_addr}:{env.master_port}",
                                    rank=env.rank, world_size=env.world_size, timeout=timeout, device_id=device_id)
        logger.debug("rank %d/%d joined process group (%s)", env.rank, env.world_size, backend)
