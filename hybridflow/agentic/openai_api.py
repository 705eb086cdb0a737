"""The OpenAI-compatible endpoint in front of the rollout engine, the engine's side: `OpenAIServer` starts the
endpoint's process (`endpoint_process`: aiohttp, `/v1/chat/completions`, `/v1/completions`, `/v1/models`, also under
`/s/<session>/v1/...` — the session id in the base URL, so a stock `openai.AsyncOpenAI` client bound to it needs no
extra header; `X-Session-Id` or the body's `user` work too) and reads its requests as `Call`s from a pipe (`Inbox`);
whoever serves (the engine's `AgentScheduler`, on the thread that owns the model) answers them with `reply_all`.
The responses' bodies are built here (`chat_response`, `completion_response`), from the engine's tokens.

Decision: aiohttp, in a process of its own. aiohttp is already installed with `ray[default]` and needs no server
process manager or signal handling of its own; the process keeps the handlers' Python off the interpreter lock of
the thread driving the model (`endpoint_process` says what that cost). Between rollouts nobody serves and requests
get 503 from the endpoint itself. The agent tasks run on an event loop in a background thread of this process
(`OpenAIServer.run`) or in agent processes (`agent_pool`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from hybridflow.agentic.formats import TOOL_CALL_RE, HermesFormat

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered to the client with `status` (400: the request is wrong; 503: no rollout is running)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self) -> tuple:  # crosses the pipe to the endpoint with its status
        return ApiError, (str(self), self.status)


@dataclass
class Call:
    """One HTTP request on its way to the engine. `reply(dict | ApiError)` answers it, once; `replies` sends a batch
    of (request id, result, admitted, answered) to the endpoint that holds the request open."""

    kind: str  # chat | completion
    session: str
    body: dict[str, Any]
    rid: int = 0  # the endpoint's id of the request
    replies: Callable[[list[tuple]], None] | None = None
    arrived: float = 0.0  # time.monotonic() when the handler got the request (one clock for the host's processes)
    admitted: float = 0.0  # when the engine put it into KV slots (0: never)
    answered: float = 0.0  # when the engine replied
    followup: bool = False  # the session had an earlier answered request

    def reply(self, result: dict[str, Any] | Exception) -> None:
        reply_all([(self, result)])


def reply_all(replies: list[tuple[Call, dict[str, Any] | Exception]]) -> None:
    """Answer calls: one message per endpoint for all of them (a decode chunk's finished requests together)."""
    now = time.monotonic()
    by_dest: dict[Callable[[list[tuple]], None], list[tuple]] = {}
    for call, result in replies:
        call.answered = now
        if call.replies is not None:
            by_dest.setdefault(call.replies, []).append((call.rid, result, call.admitted, now))
    for send, items in by_dest.items():
        send(items)


class Inbox:
    """The engine's end of the endpoint's pipe, read like a `queue.Queue` of `Call`s (`get`, `get_nowait`, `empty`);
    other messages (the port, latency metrics) wait in `control`."""

    def __init__(self, conn: Connection, send_replies: Callable[[list[tuple]], None]) -> None:
        self.conn, self.send_replies = conn, send_replies
        self.buf: deque[Call] = deque()
        self.control: deque[tuple[str, Any]] = deque()

    def _read(self, timeout: float | None) -> bool:
        """Read every message ready (waiting up to `timeout` for the first); False when none came."""
        if not self.conn.poll(timeout):
            return False
        while True:
            try:
                kind, payload = self.conn.recv()
            except (EOFError, OSError) as err:
                raise RuntimeError("the OpenAI endpoint's process exited (see its log above)") from err
            if kind == "calls":
                self.buf.extend(Call(k, session, body, rid, self.send_replies, arrived, followup=followup)
                                for rid, k, session, body, arrived, followup in payload)
            else:
                self.control.append((kind, payload))
            if not self.conn.poll(0):
                return True

    def get(self, timeout: float | None = None) -> Call:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._read(left) or (left == 0.0 and not self.buf):
                raise queue.Empty
        return self.buf.popleft()

    def get_nowait(self) -> Call:
        return self.get(0.0)

    def empty(self) -> bool:
        if not self.buf:
            self._read(0.0)
        return not self.buf

    def wait_control(self, kind: str, timeout: float) -> Any:
        """The payload of the next control message `kind` (calls read meanwhile stay in `buf`)."""
        deadline = time.monotonic() + timeout
        while True:
            for i, (k, payload) in enumerate(self.control):
                if k == kind or k == "error":
                    del self.control[i]
                    if k == "error":
                        raise RuntimeError(f"the OpenAI endpoint failed: {payload}")
                    return payload
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {kind!r} message from the OpenAI endpoint's process in {timeout:.0f} s")
            self._read(left)


# ---------------------------------------------------------------------------------------------------- responses
def split_tool_calls(text: str) -> tuple[str, list[dict[str, Any]] | None, bool]:
    """(content, tool_calls, malformed) of an assistant turn in the Hermes format. A malformed call leaves the
    whole text as content and no calls (the agent sees what the model wrote)."""
    calls = HermesFormat().parse(text)
    if not calls:
        return text, None, False
    if any(c.error is not None for c in calls):
        return text, None, True
    out = [{"id": f"call_{uuid.uuid4().hex[:16]}", "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]
    return TOOL_CALL_RE.sub("", text).strip(), out, False


MAX_TOP_LOGPROBS = 20
KEEPALIVE_S = 3600.0  # seconds an idle connection stays open (above the agents' clients' 3000 s)


def tool_choice(body: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(the call a chat request requires: None, "*" for any or a function's name; the tools to render in the prompt).
    Nothing constrains decoding: a named function is the only tool the prompt shows, and an answer without the
    required call is returned as written (the caller counts it)."""
    tools, choice = body.get("tools") or None, body.get("tool_choice")
    if choice in (None, "auto", "none"):
        return None, tools
    if not tools:
        raise ApiError(f"tool_choice={choice!r} needs 'tools'")
    if choice == "required":
        return "*", tools
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ApiError(f"tool_choice={choice!r}: give 'auto', 'none', 'required' or "
                       "{'type': 'function', 'function': {'name': <a tool's name>}}")
    named = [t for t in tools if isinstance(t, dict) and (t.get("function") or {}).get("name") == name]
    if not named:
        raise ApiError(f"tool_choice names {name!r}, which is not among the tools "
                       f"{[(t.get('function') or {}).get('name') for t in tools if isinstance(t, dict)]}")
    return name, named


@dataclass
class Choice:
    text: str  # decoded sampled text, stop string cut off
    token_ids: list[int]
    logprobs: list[float]
    tokens: list[str]  # each sampled id decoded alone (for `logprobs`)
    finish_reason: str  # stop | length
    message: dict[str, Any] | None = None  # chat: the assistant message returned
    top: list[list[tuple[str, float]]] | None = None  # chat `top_logprobs`: per sampled id, k (token, log-prob)


def chat_response(model: str, choices: list[Choice], prompt_tokens: int, want_logprobs: bool) -> dict[str, Any]:
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "usage": _usage(prompt_tokens, choices),
            "choices": [{"index": i, "message": c.message, "token_ids": c.token_ids,
                         "finish_reason": "tool_calls" if c.message.get("tool_calls") else c.finish_reason,
                         "logprobs": {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                                                   "top_logprobs": [_top(a, b) for a, b in top]}
                                                  for t, lp, top in zip(c.tokens, c.logprobs, c.top or _none(c))]}
                         if want_logprobs else None} for i, c in enumerate(choices)]}


def _top(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def _none(c: Choice) -> list[list]:
    return [[] for _ in c.tokens]


def completion_response(model: str, choices: list[Choice], prompt_tokens: int, want_logprobs: bool
                        ) -> dict[str, Any]:
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "usage": _usage(prompt_tokens, choices),
            "choices": [{"index": i, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                         "logprobs": {"tokens": c.tokens, "token_logprobs": c.logprobs, "top_logprobs": None,
                                      "text_offset": None} if want_logprobs else None}
                        for i, c in enumerate(choices)]}


def _usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


# ------------------------------------------------------------------------------------------------------- server
class OpenAIServer:
    """The endpoint on `host:port` (0 = a free port) in its own process; `calls` (an `Inbox`) is what the engine
    reads while serving (`set_serving`). `run(coro)` runs a coroutine (an agent task) on this process's agent loop."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, model_name: str = "policy") -> None:
        from_endpoint, endpoint_out = multiprocessing.Pipe(duplex=False)
        endpoint_in, self._to_endpoint = multiprocessing.Pipe(duplex=False)
        self._send_lock = threading.Lock()
        self._dead = False
        # the child imports what this process imports (its sys.path as PYTHONPATH: packages installed with
        # --target or added at run time are found there too)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        fds = (endpoint_out.fileno(), endpoint_in.fileno())
        self._proc: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, "-m", "hybridflow.agentic.endpoint_process", "--to-engine", str(fds[0]),
             "--from-engine", str(fds[1]), "--host", host, "--port", str(port), "--model-name", model_name],
            pass_fds=fds, env=env, start_new_session=True)
        endpoint_out.close()
        endpoint_in.close()
        self.calls = Inbox(from_endpoint, self._send_replies)
        try:
            self.port = int(self.calls.wait_control("port", timeout=120))
        except BaseException:
            self._stop_process(0.0)
            raise
        self.host = host
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="hybridflow-agents", daemon=True)
        self._thread.start()
        logger.info("OpenAI-compatible endpoint on http://%s:%d/v1 (process %d)", host, self.port, self._proc.pid)

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None and not self._dead

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def session_url(self, session: str) -> str:
        """The base URL an `openai` client uses for one session."""
        return f"{self.base_url}/s/{session}/v1"

    def _send(self, msg: tuple) -> None:
        with self._send_lock:
            self._to_endpoint.send(msg)

    def _send_replies(self, items: list[tuple]) -> None:
        try:
            self._send(("replies", items))
        except OSError as err:  # nobody holds these requests open any more; reading the inbox says why
            self._dead = True
            logger.warning("the OpenAI endpoint's process is gone (%s): %d answers dropped", err, len(items))

    def set_serving(self, on: bool) -> None:
        """Serve requests (forward them to `calls`) or answer them 503 at the endpoint. Returns once the endpoint
        has switched; when stopping, requests forwarded before that are answered 503 here."""
        self._send(("serving", on))
        self.calls.wait_control("serving", timeout=60)
        if not on:
            late, self.calls.buf = list(self.calls.buf), deque()
            reply_all([(c, ApiError("no rollout is running: the engine serves only while the trainer generates",
                                    503)) for c in late])

    def take_latency(self) -> dict[str, float]:
        """The request latencies since the last call, as `agent/` metrics; starts counting anew."""
        self._send(("latency",))
        return self.calls.wait_control("latency", timeout=60)

    def run(self, coro: Coroutine) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        if self._proc is None:
            return
        try:
            self._send(("stop",))
        except OSError as err:  # the endpoint's process is gone already (BrokenPipeError)
            logger.debug("the OpenAI endpoint's process had exited before close: %s", err)
        self._stop_process(30.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)

    def _stop_process(self, grace_s: float) -> None:
        try:
            self._proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("the OpenAI endpoint's process did not stop in %.0f s; killing it", grace_s)
            self._proc.kill()
            self._proc.wait()
        self._proc = None
        self.calls.conn.close()
        self._to_endpoint.close()
