"""Agent tasks in worker processes (`rollout.agent.workers` > 1).

The agents' own Python — the `openai` client building and parsing every request, the agent's logic, its tools —
runs on one event loop in the engine's process otherwise, sharing the interpreter lock with the model's thread and
the endpoint; with hundreds of sessions that loop, not the model, sets the pace (on an H200 at 0.5B, 256 sessions
of token-id requests reached 23% of the in-engine multi-turn throughput on one loop). A pool of spawned processes,
kept for the run, each loads the agent once (and keeps one event loop and its HTTP clients, so connections to the
endpoint stay open between calls) and runs one interleaved share of the tasks with `run_agents` against the
same endpoint (sessions are named in the URL, so which process sends a request does not matter). Each process is an
executor of its own: in one shared executor a process that finished its share (or came up first) took the next
one, so two shares ran one after the other (an H200 run: some agent tasks started 1.7 s late, the call took twice
as many decode steps) and the processes that got none stayed cold — the `openai` client's lazy imports then
delayed their first requests by ~0.5 s in the next call. The processes also warm those imports when they start,
and a call's shares start only once every process is up. Samples and
results cross the process boundary pickled: an agent's `AgentResult` must be picklable (a task whose result is not
ends as an error). Off by default (`rollout.agent.workers=1`): module globals of the agent are then per process.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from hybridflow.agentic.agents import (
    AgentFn,
    HttpClients,
    Outcome,
    load_agent,
    run_agents,
    warm_openai_client,
)
from hybridflow.utils.threads import usable_cores

MAX_AUTO_WORKERS = 8
_agent: AgentFn | None = None  # the worker process's agent, loaded once by `_load`
# the worker's event loop and HTTP clients, kept across generate calls (connections to the endpoint stay open)
_loop: asyncio.AbstractEventLoop | None = None
_clients: HttpClients | None = None


def auto_workers(requested: int) -> int:
    """`rollout.agent.workers`: 0 = one process per 4 CPU cores this process may use (at most 8; 1 = the engine's
    process) — the agents' loop gets cores of its own where the machine has them to spare."""
    if requested > 0:
        return requested
    return max(1, min(MAX_AUTO_WORKERS, usable_cores() // 4))


def _load(path: str, name: str) -> None:
    global _agent, _loop, _clients
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's "stop after this step": finish its tasks
    _agent = load_agent(path, name)
    _loop = asyncio.new_event_loop()
    asyncio.set_event_loop(_loop)
    _clients = HttpClients()
    warm_openai_client()


def _ready() -> bool:
    return _agent is not None


def _run_share(samples: list[dict[str, Any]], urls: list[str], sessions: list[str], max_concurrency: int,
               timeout_s: float) -> list[Outcome]:
    url = dict(zip(sessions, urls))
    outcomes = _loop.run_until_complete(run_agents(_agent, samples, url.__getitem__, sessions,
                                                   max_concurrency=max_concurrency, timeout_s=timeout_s,
                                                   clients=_clients))
    for i, o in enumerate(outcomes):  # one unpicklable result fails its task, not the process's whole share
        try:
            pickle.dumps(o)
        except (pickle.PicklingError, TypeError, AttributeError) as err:
            outcomes[i] = Outcome(o.session, "error", error=f"the agent's result cannot be pickled to the engine's "
                                                            f"process (rollout.agent.workers > 1): {err}",
                                  started=o.started)
    return outcomes


class AgentPool:
    def __init__(self, path: str, name: str, workers: int) -> None:
        self.workers, self.path, self.name = workers, path, name
        self._pools = self._start()

    def _start(self) -> list[ProcessPoolExecutor]:
        ctx = multiprocessing.get_context("spawn")
        pools = [ProcessPoolExecutor(1, mp_context=ctx, initializer=_load, initargs=(self.path, self.name))
                 for _ in range(self.workers)]
        self._up = [p.submit(_ready) for p in pools]  # each process starts (and loads the agent) now
        return pools

    async def run(self, samples: list[dict[str, Any]], urls: list[str], sessions: list[str], *,
                  max_concurrency: int, timeout_s: float) -> list[Outcome]:
        """`run_agents` over the pool in k interleaved shares (task i in share i mod k, share j in process j);
        outcomes in the tasks' order. The concurrency limit is split between the shares (their sum is
        `max_concurrency`)."""
        loop = asyncio.get_running_loop()
        k = min(self.workers, len(sessions), max_concurrency)
        limits = [max_concurrency // k + (j < max_concurrency % k) for j in range(k)]
        try:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in self._up))  # every process is up
            parts = await asyncio.gather(*(loop.run_in_executor(self._pools[j], _run_share, samples[j::k], urls[j::k],
                                                                sessions[j::k], limits[j], timeout_s)
                                           for j in range(k)))
        except BrokenProcessPool as err:  # a worker died (killed, out of memory) or the agent failed to load there
            self.close()
            self._pools = self._start()  # the next generate gets fresh processes
            raise RuntimeError(f"an agent worker process died or could not load rollout.agent.path={self.path!r} "
                               f"({err}); rollout.agent.workers=1 runs the agents in this process, where the "
                               "error shows directly") from err
        out: list[Outcome] = [None] * len(sessions)  # type: ignore[list-item]
        for j, part in enumerate(parts):
            out[j::k] = part
        return out

    def close(self) -> None:
        """Stop the workers now, also mid-task (an engine failure leaves shares that would keep calling)."""
        for pool in self._pools:
            procs = list(getattr(pool, "_processes", {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for p in procs:
                p.terminate()
