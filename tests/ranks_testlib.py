"""Gloo ranks for multi-process tests, forked from one forkserver per test process that imported torch and the
hybridflow stack once: a spawned rank re-imported them (torch, transformers, ~4 s of CPU each on the 2-core CI
box), which most of these tests spent more time on than on their checks. The server is a fresh process, so ranks
never inherit the test process's threads or process group; they do inherit its environment as it was when the server
started (the first rank of the test process), so a rank sets what it needs itself (MASTER_PORT, ...)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

PRELOAD = ["torch", "hybridflow.engine", "hybridflow.checkpoint"]


def rank_context() -> Any:
    """The forkserver context; its server (started by the first process made in it) preloads PRELOAD."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_ranks(fn: Callable[..., None], args: tuple, nprocs: int) -> None:
    """`torch.multiprocessing.start_processes(fn, args, nprocs)` from the preloaded forkserver; raises if a rank fails."""
    rank_context()
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def run_ranks(fn: Callable[..., None], args: tuple, nprocs: int, timeout_s: float, hang_hint: str) -> None:
    """`fn(rank, *args)` in `nprocs` processes of the preloaded forkserver; fails with `hang_hint` when a rank exits
    non-zero or is still running after `timeout_s` (then killed: a hung rank never outlives the test)."""
    ctx = rank_context()
    procs = [ctx.Process(target=fn, args=(r, *args)) for r in range(nprocs)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=timeout_s)
            assert p.exitcode == 0, f"a rank failed or hung ({hang_hint})"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
