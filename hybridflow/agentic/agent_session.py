"""Token-exact agent sessions: what the OpenAI-compatible endpoint remembers per session, so that a trajectory is the
token ids the model actually saw and sampled — never a re-rendering of the chat.

A `Branch` is one token sequence: the first prompt's ids, then the response region (sampled ids with their
log-probs, and the context ids appended between turns), plus the chat messages those ids stand for (ending with the
assistant message the endpoint returned). A request whose messages extend a branch's messages is served from that
branch: only the new messages are rendered (`ChatDelta.after_turn`) and appended to its ids. A request that repeats
a branch's request (same messages minus its last answer) forks from the point before that answer. Anything else
(history edited by the agent, or a first request) starts a new root from the chat template; when the session had
branches already, that is a *rewrite*: counted, flagged on the session, and the trajectory trains only on the
tokens actually sampled in the final root (earlier roots' sampled tokens are counted as dropped).

Messages are compared in a normal form: role, text content, and tool calls as (name, parsed arguments); ids,
`name` and `tool_call_id` fields are ignored (clients fill them in differently).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

Message = tuple[str, str, tuple[tuple[str, str], ...]]  # (role, content, ((tool name, canonical args json), ...))


def normalize(msg: Any) -> Message:
    """The comparable form of one chat message (a dict, or an object with `model_dump`)."""
    if hasattr(msg, "model_dump"):
        msg = msg.model_dump()
    if not isinstance(msg, dict) or "role" not in msg:
        raise ValueError(f"a chat message must be a dict with 'role' and 'content', got {msg!r}")
    content = msg.get("content")
    if isinstance(content, list):  # OpenAI content parts: only text parts are supported
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    calls = []
    for call in msg.get("tool_calls") or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        args = fn.get("arguments", {})
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass  # compared as the raw string
        calls.append((str(fn.get("name", "")), json.dumps(args, sort_keys=True)))
    return str(msg["role"]), str(content or ""), tuple(calls)


def as_dict(m: Message) -> dict[str, Any]:
    """A normalized message as a chat-template message."""
    out: dict[str, Any] = {"role": m[0], "content": m[1]}
    if m[2]:
        out["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": json.loads(a)}}
                             for n, a in m[2]]
    return out


@dataclass
class Branch:
    prompt: list[int]  # the trajectory's prompt: the root request's ids
    resp: list[int] = field(default_factory=list)  # sampled and appended ids after the prompt
    mask: list[int] = field(default_factory=list)  # 1 = sampled
    logp: list[float] = field(default_factory=list)
    messages: tuple[Message, ...] = ()  # what resp stands for; ends with the assistant message returned
    gen_start: int = 0  # resp index where the last completion's sampled ids begin (a repeated request forks here)
    turn_ends: list[int] = field(default_factory=list)  # resp index of each completion's last sampled id
    root: int = 0  # which root of the session this branch grew from
    slot: int | None = None  # the KV slot holding these ids, if still cached

    @property
    def last_id(self) -> int | None:
        return self.resp[-1] if self.resp else (self.prompt[-1] if self.prompt else None)

    def child(self, keep: int, new_ids: list[int]) -> Branch:
        """This branch cut to `keep` response ids, with `new_ids` appended as context."""
        return Branch(list(self.prompt), self.resp[:keep] + new_ids, self.mask[:keep] + [0] * len(new_ids),
                      self.logp[:keep] + [0.0] * len(new_ids), (), keep + len(new_ids),
                      [t for t in self.turn_ends if t < keep], self.root)

    def add_sampled(self, ids: list[int], logps: list[float], message: tuple[Message, ...]) -> None:
        self.gen_start = len(self.resp)
        self.resp += ids
        self.mask += [1] * len(ids)
        self.logp += logps
        self.messages = message
        if ids:
            self.turn_ends.append(len(self.resp) - 1)


@dataclass
class Plan:
    """How one request is served: `parent` cut to `keep` response ids plus `new_ids` (parent None: a new root whose
    prompt is `new_ids`)."""

    parent: Branch | None
    keep: int
    new_ids: list[int]
    messages: tuple[Message, ...]  # the request's messages, normalized (chat requests)

    def start(self) -> Branch:
        if self.parent is None:
            return Branch(list(self.new_ids))
        return self.parent.child(self.keep, self.new_ids)


@dataclass
class Session:
    """One agent task's conversation with the endpoint."""

    branches: list[Branch] = field(default_factory=list)  # the latest request's completions (choice order)
    roots: int = 0
    rewrites: int = 0  # requests that did not extend the session (history edited)
    dropped_tokens: int = 0  # sampled ids of abandoned roots (not trained on)
    requests: int = 0
    malformed_tool_calls: int = 0
    last_malformed: bool = False  # the latest completion had a malformed tool call
    extended: int = 0  # requests served by extending cached tokens
    overflowed: bool = False  # a request was refused for the context length (the trajectory ran out of budget)

    def plan_chat(self, messages: tuple[Message, ...], render_new: Any, render_prompt: Any) -> Plan:
        """`render_new(new_messages, last_id) -> ids` (the delta after an assistant turn); `render_prompt(messages)
        -> ids` (a whole prompt through the chat template)."""
        for b in self.branches:
            k = len(b.messages)
            if k and len(messages) > k and messages[:k] == b.messages:
                return Plan(b, len(b.resp), list(render_new([as_dict(m) for m in messages[k:]], b.last_id)),
                            messages)
        for b in self.branches:
            if b.messages and messages == b.messages[:-1]:
                return Plan(b, b.gen_start, [], messages)
        return self._new_root(list(render_prompt([as_dict(m) for m in messages])), messages)

    def plan_ids(self, ids: list[int]) -> Plan:
        """A completions request given as token ids: extends the branch whose ids are a prefix of them."""
        for b in self.branches:
            full = b.prompt + b.resp
            if len(ids) > len(full) and ids[: len(full)] == full:
                return Plan(b, len(b.resp), ids[len(full):], ())
        return self._new_root(ids, ())

    def _new_root(self, prompt: list[int], messages: tuple[Message, ...]) -> Plan:
        if self.branches:
            self.rewrites += 1
            self.dropped_tokens += max(sum(b.mask) for b in self.branches)
        self.roots += 1
        return Plan(None, 0, prompt, messages)

    @property
    def rewritten(self) -> bool:
        return self.rewrites > 0

    def final(self, messages: list[Any] | None = None) -> Branch | None:
        """The branch that is the trajectory: the one the agent's final `messages` extend (or equal), else the
        latest request's first choice."""
        if messages and self.branches:
            norm = tuple(normalize(m) for m in messages)
            for b in self.branches:
                if b.messages and norm[: len(b.messages)] == b.messages:
                    return b
        return self.branches[0] if self.branches else None
