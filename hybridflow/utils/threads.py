"""CPU thread count of a run (`trainer.cpu_threads`, 0 = auto).

Why: torch's default is one intra-op thread per core. On a machine where another process is busy, those threads
spin-wait for a core they do not get: `hybridflow sft` on the tiny model took 3.7-5.2 s a step with the default
threads on a busy 2-core box and 0.09 s with one thread. `auto` uses the cores that are free now
(cores minus the 1-minute load average, at least 1); the CLI also sets OpenMP's passive wait policy before torch
loads (`OMP_WAIT_POLICY=PASSIVE`, unless set), so a thread that waits sleeps instead of spinning. An explicit
`OMP_NUM_THREADS` in the environment, or `trainer.cpu_threads=N`, wins.

On a GPU run the host only feeds the device: its tensor ops are small (rewards, advantages, batch shuffles and
packing), and on the H200 box (16 cores) one [256, 256] multiply-and-sum took 58 us on torch's default 16 threads
against 21-37 us on 1-4; in the 0.5B GRPO step the host's scoring took 40 ms with 16 threads and 11 ms with 4
(1.53 -> 1.40 s a step, docs/benchmarks.md "CPU threads of GPU runs"). So `auto` there is at most `GPU_RUN_THREADS`.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

GPU_RUN_THREADS = 4


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity; all of them where the OS has no affinity call)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def free_cores(cpu_count: int | None = None, load: float | None = None) -> int:
    """Cores not busy now: `cpu_count` minus the rounded 1-minute load average, at least 1."""
    cores = cpu_count if cpu_count is not None else usable_cores()
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return max(1, cores - int(round(load)))


def choose_cpu_threads(setting: int, env: dict[str, str] | None = None, cpu_count: int | None = None,
                       load: float | None = None, cap: int | None = None) -> tuple[int, str]:
    """(threads, why) for `trainer.cpu_threads=setting`; `cap` bounds the automatic choice only."""
    env = os.environ if env is None else env
    if setting < 0:
        raise ValueError(f"trainer.cpu_threads={setting}: use 0 (auto: the free cores) or a positive count")
    if setting > 0:
        return setting, f"trainer.cpu_threads={setting}"
    if env.get("OMP_NUM_THREADS", "").strip().isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return int(env["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    cores = cpu_count if cpu_count is not None else usable_cores()
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    n = free_cores(cores, load)
    if cap is not None and n > cap:
        return cap, f"auto: {cores} cores, load {load:.1f}, at most {cap} on a GPU run"
    return n, f"auto: {cores} cores, load {load:.1f}"


def apply_cpu_threads(setting: int, device: str) -> str:
    """Set torch's intra-op threads for a run on `device` (a GPU run: at most `GPU_RUN_THREADS` when automatic);
    returns the line the run header prints."""
    import torch

    gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    n, why = choose_cpu_threads(setting, cap=GPU_RUN_THREADS if gpu else None)
    torch.set_num_threads(n)
    line = f"cpu threads: {n} ({why}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')})"
    logger.debug(line)  # the command prints it (commands/common.py): once on stderr
    return line
