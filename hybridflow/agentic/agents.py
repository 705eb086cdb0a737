"""Bring your own agent: the plugin interface, its loading, and running one agent task per sample x rollout.n.

An agent is `async def run(client, sample) -> AgentResult` (or an `Agent` subclass with that method), loaded from
`rollout.agent.path` + `rollout.agent.name`. `client` is an `openai.AsyncOpenAI` bound to the engine's endpoint
with the task's own session id in its base URL; `sample` is the dataset row (`raw_prompt`, `reward_model`,
`extra_info`, ...). Whatever the agent does with the client is recorded token by token (`agent_session.py`).

An `Environment` (`reset(sample) -> messages`, `step(assistant message) -> EnvStep`) becomes an agent through
`EnvironmentAgent`: the loop of requests is written once, here.

Failures never hang a step: an agent that raises (an HTTP error included) or runs past `rollout.agent.timeout_s`
ends its trajectory with the reason recorded (`Outcome.kind` = error | timeout); the caller counts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import inspect
import logging
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

logger = logging.getLogger(__name__)

AgentFn = Callable[[openai.AsyncOpenAI, dict[str, Any]], Awaitable[Any]]


@dataclass
class AgentResult:
    """What an agent task returns. `reward` None: the configured reward function alone scores the response;
    otherwise it is added on the last sampled token. `turn_rewards[i]` lands on the last token of the i-th
    completion of the trajectory. `messages`: the final conversation (picks the trajectory when the agent sampled
    several choices)."""

    reward: float | None = None
    turn_rewards: list[float] = field(default_factory=list)
    messages: list[dict[str, Any]] | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # averaged over tasks into agent/<key>


class Agent:
    """Class form of an agent: one object serves every task (keep per-task state in locals)."""

    async def run(self, client: openai.AsyncOpenAI, sample: dict[str, Any]) -> AgentResult:
        raise NotImplementedError


@dataclass(frozen=True)
class EnvStep:
    messages: list[dict[str, Any]]  # appended after the assistant message (tool results, the user's reply)
    reward: float = 0.0  # the assistant turn's reward
    done: bool = False


class Environment:
    """A `reset`/`step` environment; a fresh object per trajectory. `tools`: OpenAI tool schemas sent with each
    request (None: none). `step` may block: it runs in a worker thread."""

    tools: list[dict[str, Any]] | None = None

    def reset(self, sample: dict[str, Any]) -> list[dict[str, Any]]:
        raise NotImplementedError

    def step(self, message: dict[str, Any]) -> EnvStep:
        raise NotImplementedError


class EnvironmentAgent(Agent):
    """Runs an `Environment` against the endpoint: request, step, append, until done or `max_turns`."""

    def __init__(self, env_cls: Callable[[], Environment], max_turns: int = 8, **request: Any) -> None:
        self.env_cls, self.max_turns, self.request = env_cls, max_turns, request

    async def run(self, client: openai.AsyncOpenAI, sample: dict[str, Any]) -> AgentResult:
        env = self.env_cls()
        messages = list(env.reset(sample))
        turn_rewards: list[float] = []
        for _ in range(self.max_turns):
            kwargs = {"tools": env.tools} if env.tools else {}
            r = await client.chat.completions.create(model="policy", messages=messages, **kwargs, **self.request)
            message = r.choices[0].message.model_dump(exclude_none=True)
            messages.append(message)
            result = await asyncio.to_thread(env.step, message)
            turn_rewards.append(float(result.reward))
            if result.done:
                break
            messages += result.messages
        return AgentResult(turn_rewards=turn_rewards, messages=messages)


def load_agent(path: str, name: str) -> AgentFn:
    """The agent `name` in `path` (a .py file or an importable module): a coroutine function, an `Agent`
    subclass or an `Environment` subclass (wrapped in `EnvironmentAgent`)."""
    where = f"rollout.agent.path={path!r}"
    if path.endswith(".py"):
        file = Path(path).expanduser()
        if not file.is_file():
            raise ValueError(f"{where}: no such file; point it at a .py file defining {name}")
        spec = importlib.util.spec_from_file_location(f"hybridflow_agent_{file.stem}", file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(path)
        except ImportError as err:
            raise ValueError(f"{where}: cannot import it ({err}); give a .py file or a module on PYTHONPATH") from None
    obj = getattr(module, name, None)
    if isinstance(obj, type) and issubclass(obj, Environment):
        return EnvironmentAgent(obj).run
    if isinstance(obj, type) and issubclass(obj, Agent):
        obj = obj().run
    if not inspect.iscoroutinefunction(obj):
        raise ValueError(f"rollout.agent.name={name!r}: {path} must define `async def {name}(client, sample)`, an "
                         f"Agent subclass or an Environment subclass; found {type(obj).__name__}")
    return obj


@dataclass
class Outcome:
    session: str
    kind: str  # ok | error | timeout
    result: AgentResult = field(default_factory=AgentResult)
    error: str | None = None
    started: float = 0.0  # time.monotonic() when the task began (one clock for every process of the host)


def as_result(value: Any) -> AgentResult:
    if isinstance(value, AgentResult):
        return value
    if value is None:
        return AgentResult()
    if isinstance(value, (int, float)):
        return AgentResult(reward=float(value))
    raise TypeError(f"an agent returns AgentResult, a number (its reward) or None; got {type(value).__name__}")


# idle connections kept this long by the agents' clients (httpx's default is 5 s: a training step between two
# generate calls would drop them); the endpoint keeps them longer (openai_api.KEEPALIVE_S), so it never closes one
# a client is about to reuse
KEEPALIVE_S = 3000.0


def warm_openai_client() -> None:
    """Pay the `openai` client's lazy imports (its resources and response models, ~0.5 s) now, not in the first
    request of an agent task."""
    import openai.types.chat.chat_completion  # noqa: F401
    import openai.types.completion  # noqa: F401

    client = openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="hybridflow", max_retries=0)
    _ = client.chat.completions, client.completions


class HttpClients:
    """Small HTTP clients, one per running agent task, kept open for the next tasks and generate calls of the same
    event loop: a task's first request then reuses a connection the endpoint already accepted (making the client
    and connecting cost ~0.5 ms of the agents' process each, one after another, at the start of every call).
    One client per task, not one shared: httpx's shared pool assigns requests to connections in O(connections x
    requests), which at hundreds of concurrent sessions costs more than the model. The TLS context (built per client
    otherwise, and unused on http://) is shared."""

    def __init__(self) -> None:
        self.tls = ssl.create_default_context()
        self.free: list[tuple[float, httpx.AsyncClient]] = []

    @contextlib.asynccontextmanager
    async def lease(self, timeout_s: float) -> AsyncIterator[httpx.AsyncClient]:
        # the most recently used first: its connection is the least likely to have been dropped
        kept = next((i for i in range(len(self.free) - 1, -1, -1) if self.free[i][0] == timeout_s), None)
        http = (self.free.pop(kept)[1] if kept is not None
                else httpx.AsyncClient(verify=self.tls, timeout=httpx.Timeout(timeout_s + 5),
                                       limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S)))
        try:
            yield http
        finally:
            if not http.is_closed:  # an agent may close its client (`await client.close()`, `async with client`)
                self.free.append((timeout_s, http))

    async def aclose(self) -> None:
        clients, self.free = self.free, []
        for _, http in clients:
            await http.aclose()


async def run_agents(agent: AgentFn, samples: list[dict[str, Any]], session_url: Callable[[str], str],
                     sessions: list[str], *, max_concurrency: int, timeout_s: float,
                     clients: HttpClients | None = None) -> list[Outcome]:
    """One task per sample (already repeated n times), `max_concurrency` at once, each bounded by `timeout_s`.
    `clients`: HTTP clients kept from earlier calls on this event loop (None: fresh ones, closed at the end)."""
    limit = asyncio.Semaphore(max_concurrency)
    own = clients is None
    clients = HttpClients() if own else clients

    async def one(sid: str, sample: dict[str, Any]) -> Outcome:
        async with limit, clients.lease(timeout_s) as http:
            started = time.monotonic()
            client = openai.AsyncOpenAI(base_url=session_url(sid), api_key="hybridflow", max_retries=0,
                                        http_client=http)
            try:
                out = Outcome(sid, "ok", as_result(await asyncio.wait_for(agent(client, sample), timeout_s)))
            except asyncio.TimeoutError:
                out = Outcome(sid, "timeout", error=f"timed out after {timeout_s}s")
            except Exception as err:  # noqa: BLE001 — a user agent may raise anything; the trajectory records it
                logger.debug("agent task %s raised %s: %s", sid, type(err).__name__, err)
                out = Outcome(sid, "error", error=f"{type(err).__name__}: {err}")
            out.started = started
            return out

    tasks = [asyncio.ensure_future(one(sid, s)) for sid, s in zip(sessions, samples)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        # an agent raising a BaseException (e.g. CancelledError) ends the gather early: its siblings must not live
        # on in a kept event loop and send requests for this call's sessions during the next call
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if own:
            await clients.aclose()
