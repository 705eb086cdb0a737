"""CPU thread count for runs on the CPU (`trainer.cpu_threads`, 0 = auto).

Why: torch's default is one intra-op thread per core. On a machine where another process is busy, those threads
spin-wait for a core they do not get: `hybridflow sft` on the tiny model took 3.7-5.2 s a step with the default
threads on a busy 2-core box and 0.09 s with one thread (issue 25). `auto` uses the cores that are free now
(cores minus the 1-minute load average, at least 1); the CLI also sets OpenMP's passive wait policy before torch
loads (`OMP_WAIT_POLICY=PASSIVE`, unless set), so a thread that waits sleeps instead of spinning. An explicit
`OMP_NUM_THREADS` in the environment, or `trainer.cpu_threads=N`, wins.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def free_cores(cpu_count: int | None = None, load: float | None = None) -> int:
    """Cores not busy now: `cpu_count` minus the rounded 1-minute load average, at least 1."""
    cores = cpu_count if cpu_count is not None else (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                                     else os.cpu_count() or 1)
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return max(1, cores - int(round(load)))


def choose_cpu_threads(setting: int, env: dict[str, str] | None = None, cpu_count: int | None = None,
                       load: float | None = None) -> tuple[int, str]:
    """(threads, why) for `trainer.cpu_threads=setting`."""
    env = os.environ if env is None else env
    if setting < 0:
        raise ValueError(f"trainer.cpu_threads={setting}: use 0 (auto: the free cores) or a positive count")
    if setting > 0:
        return setting, f"trainer.cpu_threads={setting}"
    if env.get("OMP_NUM_THREADS", "").strip().isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return int(env["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    cores = cpu_count if cpu_count is not None else (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                                     else os.cpu_count() or 1)
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    n = free_cores(cores, load)
    return n, f"auto: {cores} cores, load {load:.1f}"


def apply_cpu_threads(setting: int, device: str) -> str | None:
    """Set torch's intra-op threads for a CPU run; returns the line the run header prints (None on GPU runs,
    whose CPU threads only feed the GPU)."""
    import torch

    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return None
    n, why = choose_cpu_threads(setting)
    torch.set_num_threads(n)
    line = f"cpu threads: {n} ({why}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')})"
    logger.info(line)
    return line
