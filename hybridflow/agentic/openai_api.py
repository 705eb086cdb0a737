"""The OpenAI-compatible HTTP endpoint in front of the rollout engine: `/v1/chat/completions`, `/v1/completions`,
`/v1/models`, also under `/s/<session>/v1/...` (the session id in the base URL, so a stock `openai.AsyncOpenAI`
client bound to it needs no extra header; `X-Session-Id` or the body's `user` work too).

Decision: aiohttp. The server runs inside an asyncio loop in one background thread that we own (agent tasks run on
the same loop), with no server process and no signal handling of its own; aiohttp is already installed with
`ray[default]`. The handlers only parse and answer: each request goes, as a `Call`, to whoever serves (the engine's
`AgentScheduler`, on the thread that owns the model) and the answer comes back through the loop. Between rollouts
nobody serves and requests get 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import socket
import threading
import time
import uuid
from collections.abc import Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from hybridflow.agentic.formats import TOOL_CALL_RE, HermesFormat

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered to the client with `status` (400: the request is wrong; 503: no rollout is running)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Call:
    """One HTTP request on its way to the engine. `reply(dict | ApiError)` may be called from any thread, once."""

    kind: str  # chat | completion
    session: str
    body: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    arrived: float = 0.0  # time.monotonic() when the handler got the request
    admitted: float = 0.0  # when the engine put it into KV slots (0: never)
    answered: float = 0.0  # when the engine replied
    followup: bool = False  # the session had an earlier answered request

    def reply(self, result: dict[str, Any] | Exception) -> None:
        reply_all([(self, result)])


def reply_all(replies: list[tuple[Call, dict[str, Any] | Exception]]) -> None:
    """Answer calls from any thread with one wake-up of each calls' loop: every wake-up hands the interpreter lock
    to the loop's thread, which the engine's thread then waits to get back."""
    now = time.monotonic()
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Call, dict[str, Any] | Exception]]] = {}
    for call, result in replies:
        call.answered = now
        by_loop.setdefault(call.loop, []).append((call, result))
    for loop, items in by_loop.items():
        if loop.is_closed():  # the endpoint was closed (run teardown): nobody waits for these answers any more
            logger.debug("dropping %d replies: the endpoint's loop is closed", len(items))
            continue
        loop.call_soon_threadsafe(_set_results, items)


def _set_results(replies: list[tuple[Call, dict[str, Any] | Exception]]) -> None:
    for call, result in replies:
        if call.future.done():  # the client went away (its agent timed out)
            continue
        if isinstance(result, Exception):
            call.future.set_exception(result)
        else:
            call.future.set_result(result)


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


def sse_chunks(result: dict[str, Any], stream_options: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole response as the chunks of `stream: true` (the `data:` events before `[DONE]`). The engine answers
    finished completions, so the stream carries no earlier tokens: per choice, one chunk with the role, the content,
    its log-probs and `token_ids`, then one with the tool calls (if any) and the finish reason; then, with
    `stream_options.include_usage`, a chunk with no choices and the usage."""
    head = {k: result[k] for k in ("id", "created", "model")}
    chat = result["object"] == "chat.completion"
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    chunks = []
    for c in result["choices"]:
        if chat:
            msg = c["message"]
            delta = {"role": "assistant", "content": msg.get("content") or ""}
            first = {"index": c["index"], "delta": delta, "logprobs": c["logprobs"], "finish_reason": None,
                     "token_ids": c["token_ids"]}
            calls = [{"index": i, **call} for i, call in enumerate(msg.get("tool_calls") or [])]
            last = {"index": c["index"], "delta": {"tool_calls": calls} if calls else {}, "logprobs": None,
                    "finish_reason": c["finish_reason"]}
        else:
            first = {**c, "finish_reason": None}
            last = {"index": c["index"], "text": "", "logprobs": None, "finish_reason": c["finish_reason"]}
        chunks += [{**head, "choices": [first]}, {**head, "choices": [last]}]
    if stream_options.get("include_usage"):
        chunks.append({**head, "choices": [], "usage": result["usage"]})
    return chunks


def _usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


# ------------------------------------------------------------------------------------------------------- server
@dataclass
class Latency:
    """Where a request's time goes outside the model, summed on the server's loop: queued (arrival in the handler ->
    admitted into KV slots), answering (the engine's reply -> response serialised) and each session's gap between a
    response and its next request's arrival (the agent: its client, its tools, the connection)."""

    queued_s: float = 0.0
    admitted: int = 0
    queued_next_s: float = 0.0  # the part of queued_s of follow-up requests (a session's 2nd, 3rd, ... request)
    admitted_next: int = 0
    answer_s: float = 0.0
    answered: int = 0
    gap_s: float = 0.0
    gaps: int = 0
    last: dict[str, float] = field(default_factory=dict)  # session -> when its last response was serialised

    def arrive(self, session: str, now: float) -> bool:
        """Count the session's gap; True when it is a follow-up request."""
        if session in self.last:
            self.gap_s += now - self.last.pop(session)
            self.gaps += 1
            return True
        return False

    def replied(self, call: Call, now: float) -> None:
        if call.admitted:
            self.queued_s += call.admitted - call.arrived
            self.admitted += 1
            if call.followup:
                self.queued_next_s += call.admitted - call.arrived
                self.admitted_next += 1
        self.answer_s += now - call.answered
        self.answered += 1
        self.last[call.session] = now

    def metrics(self) -> dict[str, float]:
        first = self.admitted - self.admitted_next
        return {"agent/queued_ms": 1e3 * self.queued_s / max(self.admitted, 1),
                "agent/queued_first_ms": 1e3 * (self.queued_s - self.queued_next_s) / max(first, 1),
                "agent/queued_next_ms": 1e3 * self.queued_next_s / max(self.admitted_next, 1),
                "agent/answer_ms": 1e3 * self.answer_s / max(self.answered, 1),
                "agent/turn_gap_ms": 1e3 * self.gap_s / max(self.gaps, 1)}


class OpenAIServer:
    """The endpoint on `host:port` (0 = a free port), served from a background thread's asyncio loop; `calls` is
    the queue the engine reads while `serving` is set. `run(coro)` runs a coroutine (an agent task) on that loop."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, model_name: str = "policy") -> None:
        self.model_name = model_name
        self.calls: queue.Queue[Call] = queue.Queue()
        self.serving = threading.Event()
        self.latency = Latency()  # replaced per rollout (`take_latency`)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="hybridflow-openai", daemon=True)
        self._thread.start()
        self._runner: web.AppRunner | None = None
        self.port = self.run(self._start(host, port)).result(timeout=30)
        self.host = host
        logger.info("OpenAI-compatible endpoint on http://%s:%d/v1", host, self.port)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def session_url(self, session: str) -> str:
        """The base URL an `openai` client uses for one session."""
        return f"{self.base_url}/s/{session}/v1"

    def take_latency(self) -> dict[str, float]:
        """The request latencies since the last call, as `agent/` metrics; starts counting anew."""
        async def swap() -> Latency:
            old, self.latency = self.latency, Latency()
            return old
        return self.run(swap()).result(timeout=30).metrics()

    def run(self, coro: Coroutine) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def _start(self, host: str, port: int) -> int:
        app = web.Application(client_max_size=64 * 2**20)
        for prefix in ("", "/s/{session}"):
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            app.router.add_post(prefix + "/v1/completions", self._completion)
            app.router.add_get(prefix + "/v1/models", self._models)
        # agents' HTTP clients keep their connections between generate calls, which a training step can space by
        # minutes: idle connections stay open longer than the clients keep them (agents.KEEPALIVE_S)
        self._runner = web.AppRunner(app, access_log=None, keepalive_timeout=KEEPALIVE_S)
        await self._runner.setup()
        sock = socket.create_server((host, port))  # bound here, so port 0 tells us the port it got
        await web.SockSite(self._runner, sock).start()
        return sock.getsockname()[1]

    def close(self) -> None:
        if self._runner is None:
            return
        self.run(self._runner.cleanup()).result(timeout=30)
        self._runner = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                               "owned_by": "hybridflow"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        return await self._serve("chat", request)

    async def _completion(self, request: web.Request) -> web.Response:
        return await self._serve("completion", request)

    async def _serve(self, kind: str, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ApiError("the request body must be a JSON object")
            session = request.match_info.get("session") or request.headers.get("X-Session-Id") \
                or str(body.get("user") or "") or f"anon-{uuid.uuid4().hex}"
            if not self.serving.is_set():
                raise ApiError("no rollout is running: the engine serves only while the trainer generates", 503)
            followup = self.latency.arrive(session, arrived)
            call = Call(kind, session, body, asyncio.get_running_loop(), asyncio.get_running_loop().create_future(),
                        arrived, followup=followup)
            self.calls.put(call)
            result = await call.future
            if body.get("stream"):
                resp = await _stream(request, sse_chunks(result, body.get("stream_options") or {}))
            else:
                resp = web.json_response(result)  # serialised here; aiohttp writes it on return
            self.latency.replied(call, time.monotonic())
            return resp
        except ApiError as err:
            return _error(str(err), err.status)
        except json.JSONDecodeError as err:
            return _error(f"the request body is not JSON: {err}", 400)


async def _stream(request: web.Request, chunks: list[dict[str, Any]]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    for chunk in chunks:
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _error(message: str, status: int) -> web.Response:
    kind = "invalid_request_error" if status == 400 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)
