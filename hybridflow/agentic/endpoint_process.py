"""The OpenAI-compatible HTTP endpoint's own process: aiohttp serving `/v1/chat/completions`, `/v1/completions` and
`/v1/models` (also under `/s/<session>/v1/...`), handing each request to the engine's process over a pipe and
writing the answer that comes back.

Why a process: in the engine's process the endpoint's thread and the thread that drives the model share one
interpreter lock. With hundreds of agent sessions the handlers' Python (HTTP parsing, JSON, responses) then
delayed the engine's loop at every turn — the engine took the first wave's requests hundreds of ms after they
arrived, and its host work between decode chunks waited on the lock. Here the handlers have an interpreter of their
own; the engine reads ready requests from a pipe (`openai_api.Inbox`) and answers a decode chunk's finished requests
in one message.

The process is started as `python -m hybridflow.agentic.endpoint_process` (not multiprocessing's spawn, which
re-runs the user's `__main__` script in the child — a training script without an `if __name__ == "__main__":` guard
would train again there), in a session of its own and ignoring SIGINT: Ctrl-C in the terminal means "stop after
this step" to the trainer (`trainer/stop.py`), and the endpoint must keep serving that step. It exits on "stop" or
when the engine's process goes away (its pipe closes).

Messages, engine <- endpoint (one pipe): ("port", int) once at start, or ("error", str); ("calls", [(rid, kind,
session, body, arrived, followup), ...]) — what arrived since the last message, sent by a writer thread so a busy
engine never blocks the event loop; ("latency", {metric: value}) and ("serving", bool) in answer to those requests.
Engine -> endpoint (another pipe, read by a reader thread): ("replies", [(rid, result | ApiError, admitted,
answered), ...]); ("serving", bool) — requests get 503 while false (the answer confirms every later request sees
it); ("latency",); ("stop",).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import queue
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from aiohttp import web

from hybridflow.agentic.openai_api import KEEPALIVE_S, ApiError

logger = logging.getLogger(__name__)


@dataclass
class Latency:
    """Where a request's time goes outside the model, summed on the endpoint: queued (arrival in the handler ->
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

    def replied(self, session: str, followup: bool, arrived: float, admitted: float, answered: float,
                now: float) -> None:
        if admitted:
            self.queued_s += admitted - arrived
            self.admitted += 1
            if followup:
                self.queued_next_s += admitted - arrived
                self.admitted_next += 1
        self.answer_s += now - answered
        self.answered += 1
        self.last[session] = now

    def metrics(self) -> dict[str, float]:
        first = self.admitted - self.admitted_next
        return {"agent/queued_ms": 1e3 * self.queued_s / max(self.admitted, 1),
                "agent/queued_first_ms": 1e3 * (self.queued_s - self.queued_next_s) / max(first, 1),
                "agent/queued_next_ms": 1e3 * self.queued_next_s / max(self.admitted_next, 1),
                "agent/answer_ms": 1e3 * self.answer_s / max(self.answered, 1),
                "agent/turn_gap_ms": 1e3 * self.gap_s / max(self.gaps, 1)}


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


class Endpoint:
    """The aiohttp app and the two pipe ends, all in the endpoint's process."""

    def __init__(self, to_engine: Connection, from_engine: Connection, model_name: str) -> None:
        self.to_engine, self.from_engine = to_engine, from_engine
        self.serving = False  # set on the loop's thread, so a request handled after the answer sees it
        self.model_name = model_name
        self.latency = Latency()
        self.pending: dict[int, asyncio.Future] = {}  # request id -> its handler's future
        self.ids = iter(range(1, 1 << 62))
        self.outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopped: asyncio.Event | None = None

    # ----------------------------------------------------------------------------------------------- threads
    def _writer(self) -> None:
        """Sends what the handlers queued; the calls that came together in one message."""
        try:
            self._write_loop()
        except Exception:  # noqa: BLE001 — any failure here would leave every request waiting: stop serving
            logger.exception("the OpenAI endpoint's writer failed; stopping the endpoint")
            self.loop.call_soon_threadsafe(self.stopped.set)

    def _write_loop(self) -> None:
        while True:
            items = [self.outbox.get()]
            while True:
                try:
                    items.append(self.outbox.get_nowait())
                except queue.Empty:
                    break
            calls: list[tuple] = []
            for item in items:
                if item is not None and item[0] == "call":
                    calls.append(item[1])
                    continue
                if calls:
                    self.to_engine.send(("calls", calls))
                    calls = []
                if item is None:
                    return
                self.to_engine.send(item)
            if calls:
                self.to_engine.send(("calls", calls))

    def _reader(self) -> None:
        try:
            while True:
                try:
                    msg = self.from_engine.recv()
                except (EOFError, OSError):  # the engine's process went away
                    msg = ("stop",)
                if msg[0] == "replies":
                    self.loop.call_soon_threadsafe(self._set_results, msg[1])
                elif msg[0] == "serving":
                    self.loop.call_soon_threadsafe(self._set_serving, bool(msg[1]))
                elif msg[0] == "latency":
                    self.loop.call_soon_threadsafe(self._send_latency)
                else:
                    self.loop.call_soon_threadsafe(self.stopped.set)
                    return
        except Exception:  # noqa: BLE001 — a dead reader would leave every request waiting: stop serving
            logger.exception("the OpenAI endpoint's reader failed; stopping the endpoint")
            self.loop.call_soon_threadsafe(self.stopped.set)

    def _set_serving(self, on: bool) -> None:
        self.serving = on
        self.outbox.put(("serving", on))

    def _set_results(self, replies: list[tuple]) -> None:
        for rid, result, admitted, answered in replies:
            fut = self.pending.pop(rid, None)
            if fut is None or fut.done():  # the client went away (its agent timed out)
                continue
            fut.set_result((result, admitted, answered))

    def _send_latency(self) -> None:
        old, self.latency = self.latency, Latency()
        self.outbox.put(("latency", old.metrics()))

    # ---------------------------------------------------------------------------------------------- handlers
    async def serve(self, host: str, port: int) -> None:
        self.loop, self.stopped = asyncio.get_running_loop(), asyncio.Event()
        app = web.Application(client_max_size=64 * 2**20)
        for prefix in ("", "/s/{session}"):
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            app.router.add_post(prefix + "/v1/completions", self._completion)
            app.router.add_get(prefix + "/v1/models", self._models)
        # agents' HTTP clients keep their connections between generate calls, which a training step can space by
        # minutes: idle connections stay open longer than the clients keep them (agents.KEEPALIVE_S)
        runner = web.AppRunner(app, access_log=None, keepalive_timeout=KEEPALIVE_S)
        await runner.setup()
        try:
            sock = socket.create_server((host, port))  # bound here, so port 0 tells us the port it got
        except OSError as err:
            self.to_engine.send(("error", f"cannot listen on {host}:{port}: {err}"))
            return
        await web.SockSite(runner, sock).start()
        threading.Thread(target=self._writer, name="endpoint-writer", daemon=True).start()
        threading.Thread(target=self._reader, name="endpoint-reader", daemon=True).start()
        self.outbox.put(("port", sock.getsockname()[1]))
        await self.stopped.wait()
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(ApiError("the endpoint is closing", 503))
        await runner.cleanup()
        self.outbox.put(None)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                               "owned_by": "hybridflow"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve("chat", request)

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        return await self._serve("completion", request)

    async def _serve(self, kind: str, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the host
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ApiError("the request body must be a JSON object")
            session = request.match_info.get("session") or request.headers.get("X-Session-Id") \
                or str(body.get("user") or "") or f"anon-{uuid.uuid4().hex}"
            if not self.serving:
                raise ApiError("no rollout is running: the engine serves only while the trainer generates", 503)
            followup = self.latency.arrive(session, arrived)
            rid = next(self.ids)
            fut = self.loop.create_future()
            self.pending[rid] = fut
            self.outbox.put(("call", (rid, kind, session, body, arrived, followup)))
            try:
                result, admitted, answered = await fut
            finally:
                self.pending.pop(rid, None)
            if isinstance(result, Exception):
                raise result
            if body.get("stream"):
                resp = await _stream(request, sse_chunks(result, body.get("stream_options") or {}))
            else:
                resp = web.json_response(result)  # serialised here; aiohttp writes it on return
            self.latency.replied(session, followup, arrived, admitted, answered, time.monotonic())
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


def main(argv: list[str] | None = None) -> None:
    """`python -m hybridflow.agentic.endpoint_process --to-engine FD --from-engine FD ...`, started by
    `openai_api.OpenAIServer` with the two pipe ends passed as file descriptors."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--to-engine", type=int, required=True)
    ap.add_argument("--from-engine", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--model-name", default="policy")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle (see the module docstring)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s [openai endpoint] %(message)s")
    endpoint = Endpoint(Connection(args.to_engine, readable=False), Connection(args.from_engine, writable=False),
                        args.model_name)
    asyncio.run(endpoint.serve(args.host, args.port))


if __name__ == "__main__":
    main()
