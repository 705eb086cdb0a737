"""Agent tasks in worker processes (`rollout.agent.workers` > 1).

The agents' own Python — the `openai` client building and parsing every request, the agent's logic, its tools —
runs on one event loop in the engine's process otherwise, sharing the interpreter lock with the model's thread and
the endpoint; with hundreds of sessions that loop, not the model, sets the pace (on an H200 at 0.5B, 256 sessions
of token-id requests reached 23% of the in-engine multi-turn throughput on one loop). A pool of spawned processes,
kept for the run, each loads the agent once and runs an interleaved share of the tasks with `run_agents` against
the same endpoint (sessions are named in the URL, so which process sends a request does not matter). Samples and
results cross the process boundary pickled: an agent's `AgentResult` must be picklable.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from hybridflow.agentic.agents import AgentFn, Outcome, load_agent, run_agents

MAX_AUTO_WORKERS = 8
_agent: AgentFn | None = None  # the worker process's agent, loaded once by `_load`


def auto_workers(requested: int) -> int:
    """`rollout.agent.workers`: 0 = one process per 4 CPU cores (at most 8; 1 = the engine's process) — the
    agents' loop gets cores of its own where the machine has them to spare."""
    if requested > 0:
        return requested
    return max(1, min(MAX_AUTO_WORKERS, (os.cpu_count() or 1) // 4))


def _load(path: str, name: str) -> None:
    global _agent
    _agent = load_agent(path, name)


def _run_share(samples: list[dict[str, Any]], urls: list[str], sessions: list[str], max_concurrency: int,
               timeout_s: float) -> list[Outcome]:
    url = dict(zip(sessions, urls))
    return asyncio.run(run_agents(_agent, samples, url.__getitem__, sessions, max_concurrency=max_concurrency,
                                  timeout_s=timeout_s))


class AgentPool:
    def __init__(self, path: str, name: str, workers: int) -> None:
        self.workers = workers
        self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_load, initargs=(path, name))

    async def run(self, samples: list[dict[str, Any]], urls: list[str], sessions: list[str], *,
                  max_concurrency: int, timeout_s: float) -> list[Outcome]:
        """`run_agents` over the pool: task i goes to worker i mod workers; outcomes in the tasks' order."""
        loop = asyncio.get_running_loop()
        k = min(self.workers, len(sessions))
        per = max(1, -(-max_concurrency // k))  # the concurrency limit, split between the processes
        parts = await asyncio.gather(*(loop.run_in_executor(self._pool, _run_share, samples[j::k], urls[j::k],
                                                            sessions[j::k], per, timeout_s) for j in range(k)))
        out: list[Outcome] = [None] * len(sessions)  # type: ignore[list-item]
        for j, part in enumerate(parts):
            out[j::k] = part
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
