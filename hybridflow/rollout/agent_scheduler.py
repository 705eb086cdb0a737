"""`AgentScheduler`: continuous batching of OpenAI-API requests from many agent sessions on one `ModelRunner`.

The thread that owns the model runs `serve`: it takes the requests in flight off the endpoint's queue, admits each
into KV slots — a request that extends its session's cached tokens is *extended* in its slot (`extend_many`: only
the new context ids are prefilled, all such slots in one batched forward), any other is prefilled — then decodes
all live slots together and answers each request when its slots finish, like the multi-turn scheduler does with
tool calls. A finished slot keeps its KV cache for the session's next request; when a new request finds no free
slot, the least recently used idle slot is evicted (its session's next request is prefilled from the recorded ids,
token-exact still). Every slot's prompt is left-padded to data.max_prompt_length (history re-admitted after an
eviction may be wider); the response region holds R = data.max_response_length ids of the session.

Sampling settings are shared by the slots decoding together (the runner's sampler takes one temperature/top-k/top-p),
so a request asking for different ones waits until the live slots drain. `stop` strings are applied at the end of
a completion: the ids after the one completing the string are dropped from the trajectory and the slot rolls back.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from jinja2 import TemplateError

from hybridflow.agentic.agent_session import Branch, Plan, Session, normalize
from hybridflow.agentic.chat_delta import ChatDelta
from hybridflow.agentic.openai_api import (
    MAX_TOP_LOGPROBS,
    ApiError,
    Call,
    Choice,
    Inbox,
    chat_response,
    completion_response,
    reply_all,
    split_tool_calls,
    tool_choice,
)
from hybridflow.rollout.model_runner import ModelRunner, Readout
from hybridflow.rollout.sampling import SamplingParams, row_seed
from hybridflow.rollout.top_logprobs import top_logprobs
from hybridflow.utils.device import to_device
from hybridflow.utils.progress import beat
from hybridflow.utils.tokenizer_protocol import Tokenizer

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.02  # longest wait for a request when no slot is decoding
# with no slot decoding, the first request waits this long for more: agents answered together come back spread out
# (each agent process sends its share one after another), and one forward + decode chunk for the wave beats one each
GATHER_S = 0.003
# the call's first wave: while sessions that have not yet sent a request remain, an idle engine keeps gathering as
# long as first requests keep coming (each within FIRST_WAVE_GAP_S of the last, up to FIRST_WAVE_MAX_S after the
# wave's first request). The agents' first requests arrive over ~100-500 ms (clients in several processes, one
# endpoint thread); admitting the first few alone split the prefill and left the rest queued behind it and a decode
# chunk (H200, 256 sessions: two 128-row prefills, the second 436-847 ms into the call).
FIRST_WAVE_GAP_S = 0.02
FIRST_WAVE_MAX_S = 1.0


@dataclass
class Job:
    call: Call
    session: Session
    plan: Plan
    params: SamplingParams
    max_tokens: int
    stops: list[str]
    logprobs: bool
    parse_tools: bool
    seeds: list[int]
    require: str | None = None  # tool_choice: "*" (required) or the function's name
    top: int = 0  # top_logprobs
    branches: list[Branch] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    start: dict[int, int] = field(default_factory=dict)  # slot -> slot step where this completion's ids begin
    out: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)

    @property
    def key(self) -> tuple:
        p = self.params
        return p.mode, p.temperature, p.top_k, p.top_p, p.stop_token_ids, p.ignore_eos


@dataclass
class SlotInfo:
    width: int  # prompt columns at admission
    hist: int  # response ids of the branch inside that prompt (re-admitted history)
    pos0: int  # real tokens in the prompt = the position of response index 0
    owner: Branch | None = None  # the branch whose ids the slot caches (None while a job samples into it)
    used: int = 0  # admission counter, for least-recently-used eviction


class AgentScheduler:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, chat_template: str | None, base: SamplingParams, *,
                 eos_ids: list[int], prompt_width: int, check_every: int, seed: int, sessions: int = 0,
                 overlap: bool = True) -> None:
        """`sessions`: how many agent tasks of the call run at once at its start (0: unknown) — the first wave is
        gathered until each has sent its first request (or they stop coming). `overlap`: the host's work of a loop
        (answers, new requests, admission) runs while the next decode chunk is already on the device."""
        self.r, self.tok, self.base, self.eos_ids = runner, tokenizer, base, eos_ids
        self.overlap = overlap
        # readouts of `done`/`resp_len` queued after each decode chunk, oldest first: (chunk number, readout)
        self.pending: list[tuple[int, Readout]] = []
        self.chunks = 0  # decode chunks launched (each followed by its readout)
        self.since: dict[int, int] = {}  # live slot -> the first chunk whose readout describes its current job
        self.expected = sessions
        self.wave_start: float | None = None  # arrival of the call's first request
        self.P, self.R, self.check_every, self.seed = prompt_width, runner.R, check_every, seed
        self.chat = ChatDelta(tokenizer, chat_template)
        self.sessions: dict[str, Session] = {}
        self.waiting: list[Job] = []
        self.outbox: list[tuple[Call, dict[str, Any] | Exception]] = []  # answers sent once per loop (`_send`)
        self.live: dict[int, Job] = {}  # slot -> job sampling into it
        self.host_steps: dict[int, int] = {}
        self.cap: dict[int, int] = {}  # slot -> its max_new for this completion
        self.info: dict[int, SlotInfo] = {}
        self.free = list(range(runner.cache.slots))
        heapq.heapify(self.free)
        self._key: tuple | None = None
        self._clock = itertools.count()
        self._seeds = itertools.count()
        self.stats = dict.fromkeys(("requests", "extended", "extend_tokens", "prefills", "prefilled", "prefill_tokens",
                                    "evictions", "decode_steps", "bad_requests", "tool_choice_unmet",
                                    "extends", "live_row_steps", "step_rows", "idle_s"), 0)
        self.t_start = time.monotonic()  # made right before the agents start
        self.prefill_at: list[float] = []  # seconds from t_start to each prefill forward
        self.first_arrivals: list[float] = []  # seconds from t_start to each session's first request at the endpoint
        # host seconds of the serving loop by phase (with workers=1 the agents' loop shares the interpreter lock with
        # this thread); prefill and extend: the parts of admit spent in those forwards
        self.phase_s = dict.fromkeys(("take", "admit", "prefill", "extend", "launch", "sync", "answer"), 0.0)

    # ------------------------------------------------------------------------------------------------- serving
    def serve(self, calls: Inbox | queue.Queue[Call], finished: Callable[[], bool]) -> None:
        """Serve until `finished()` (every agent task is over); requests still in flight then are answered 503."""
        try:
            while not finished() or self.live or self.waiting:
                beat()  # for the hang watchdog: waiting on agents (bounded by rollout.agent.timeout_s) is progress
                if finished():
                    break
                t0 = time.monotonic()
                self._take(calls, block=not self.live)
                t1 = time.monotonic()
                self._admit()
                self.phase_s["take"] += t1 - t0
                self.phase_s["admit"] += time.monotonic() - t1
                if self.live:
                    self._decode()
                t2 = time.monotonic()
                self._send()
                self.phase_s["answer"] += time.monotonic() - t2
        finally:  # every request still open gets an answer, also when the engine failed
            self._abort("the rollout ended")
            self._send()
            while not calls.empty():
                calls.get_nowait().reply(ApiError("the rollout ended", 503))

    def _take(self, calls: queue.Queue[Call], block: bool) -> None:
        t0 = time.monotonic()
        batch: list[Call] = []
        deadline = t0 + (IDLE_WAIT_S if block else 0.0)
        new_sessions: set[str] = set()
        in_wave = False
        while True:
            try:
                left = deadline - time.monotonic()
                batch.append(calls.get(timeout=left) if left > 0 else calls.get_nowait())
            except queue.Empty:
                break
            if not block:
                continue
            now = time.monotonic()
            if self.wave_start is None:
                self.wave_start = batch[-1].arrived or now
            new = batch[-1].session not in self.sessions and batch[-1].session not in new_sessions
            if new:
                new_sessions.add(batch[-1].session)
            if (new and len(self.sessions) + len(new_sessions) < self.expected
                    and now - self.wave_start < FIRST_WAVE_MAX_S):
                in_wave, deadline = True, now + FIRST_WAVE_GAP_S  # the first wave is still arriving
            elif in_wave and not new:
                pass  # a later request of a session seen: the wave's deadline stands
            elif in_wave:
                in_wave, deadline = False, now  # the wave is complete: take what is queued already, no more waiting
            elif len(batch) == 1:
                deadline = now + GATHER_S
        if block:
            self.stats["idle_s"] += time.monotonic() - t0
        for call in batch:
            try:
                self.waiting.append(self._job(call))
            except (ApiError, ValueError, TypeError, TemplateError) as err:  # the request's fault: answer 400
                self.stats["bad_requests"] += 1
                bad = err if isinstance(err, ApiError) else ApiError(f"{type(err).__name__}: {err}")
                self.outbox.append((call, bad))

    def _job(self, call: Call) -> Job:
        body = call.body
        want_lp = bool(body.get("logprobs")) if call.kind == "chat" else body.get("logprobs") is not None
        top = int(body.get("top_logprobs") or 0) if call.kind == "chat" else 0
        if not 0 <= top <= MAX_TOP_LOGPROBS or (top and not want_lp):
            raise ApiError(f"top_logprobs={top} must be in [0, {MAX_TOP_LOGPROBS}] and needs logprobs=true")
        session = self.sessions.setdefault(call.session, Session())
        if not session.requests:
            self.first_arrivals.append(call.arrived - self.t_start)
        session.requests += 1
        self.stats["requests"] += 1
        n = int(body.get("n") or 1)
        if n < 1 or n > self.r.cache.slots:
            raise ApiError(f"n={n} must be in [1, {self.r.cache.slots}] (the engine's KV slots)")
        if call.kind == "chat":
            if not isinstance(body.get("messages"), list) or not body["messages"]:
                raise ApiError("'messages' must be a non-empty list")
            messages = tuple(normalize(m) for m in body["messages"])
            require, tools = tool_choice(body)
            plan = session.plan_chat(messages, self.chat.after_turn, lambda msgs: self._render(msgs, tools))
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = list(self.tok.encode(prompt, add_special_tokens=False))
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                ids = list(prompt)
            else:
                raise ApiError("'prompt' must be a string or a list of token ids (one prompt per request)")
            plan = session.plan_ids(ids)
            require = None
        # no temperature given: the rollout's own sampling (validation's greedy default included)
        temperature = float(body.get("temperature", self.base.temperature if self.base.do_sample else 0.0))
        params = SamplingParams(n=n, temperature=temperature if temperature > 0 else 1.0, do_sample=temperature > 0,
                                top_p=float(body.get("top_p", self.base.top_p)),
                                top_k=int(body.get("top_k", self.base.top_k)), ignore_eos=self.base.ignore_eos,
                                stop_token_ids=self.base.stop_token_ids, seed=self.seed)
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else [str(s) for s in stops]
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or self.R
        if int(max_tokens) < 1:
            raise ApiError(f"max_tokens={max_tokens} must be >= 1")
        seed = body.get("seed")
        seeds = [row_seed(int(seed), j) if seed is not None else row_seed(self.seed, next(self._seeds))
                 for j in range(n)]
        parse_tools = call.kind == "chat" and bool(body.get("tools")) and body.get("tool_choice") != "none"
        return Job(call, session, plan, params, int(max_tokens), stops, want_lp, parse_tools, seeds, require, top)

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        text = self.tok.apply_chat_template(messages, tools=tools, chat_template=self.chat.template,
                                            tokenize=False, add_generation_prompt=True)
        return list(self.tok.encode(text, add_special_tokens=False))

    # ----------------------------------------------------------------------------------------------- admission
    def _admit(self) -> None:
        extend: list[tuple[Job, int, list[int], int]] = []  # (job, slot, new ids, slot step)
        prefill: dict[int, dict[tuple[int, int], list[tuple[Job, list[int]]]]] = {}  # n -> (width, room) -> jobs
        for job in list(self.waiting):
            if job.key != self._key:
                if self.live:
                    continue  # other sampling settings are decoding: wait until they drain
                self.r.set_sampling(job.params, self.eos_ids)
                self._key = job.key
            start = job.plan.start()
            parent = job.plan.parent
            slot = parent.slot if parent is not None and job.params.n == 1 else None
            info = self.info.get(slot) if slot is not None else None
            if info is not None and info.owner is parent:
                step = len(start.resp) - len(job.plan.new_ids) - info.hist
                # the slot's response columns end at min(R, cache length - its prompt width): a session admitted
                # wider than data.max_prompt_length (long tool schemas, a re-prefill after eviction) has fewer
                if step >= 1 and step + len(job.plan.new_ids) < min(self.R, self.r.cache.max_len - info.width):
                    self.waiting.remove(job)
                    parent.slot, info.owner = None, None
                    job.branches, job.slots = [start], [slot]
                    self.live[slot] = job  # reserved: no prefill below may evict it
                    extend.append((job, slot, job.plan.new_ids, step))
                    continue
            if self._reserve(job, start, prefill.setdefault(job.params.n, {})):
                self.waiting.remove(job)
        t0 = time.monotonic()
        for n_groups in prefill.values():
            for (width, room), group in n_groups.items():
                self._prefill(width, room, group)
        t1 = time.monotonic()
        if extend:
            self._extend(extend)
        self.phase_s["prefill"] += t1 - t0
        self.phase_s["extend"] += time.monotonic() - t1

    def _take_slots(self, k: int) -> list[int] | None:
        while len(self.free) < k:
            idle = [(info.used, s) for s, info in self.info.items() if s not in self.live]
            if not idle:
                return None
            _, s = min(idle)
            self._release(s)
            self.stats["evictions"] += 1
        return [heapq.heappop(self.free) for _ in range(k)]

    def _release(self, s: int) -> None:
        info = self.info.pop(s)
        if info.owner is not None:
            info.owner.slot = None
        heapq.heappush(self.free, s)

    def _reserve(self, job: Job, start: Branch, prefill: dict[tuple[int, int], list]) -> bool:
        """Take KV slots for `job` (prefilled from scratch) and queue it in `prefill`, grouped by (prompt width,
        max new tokens): each group is one batched forward."""
        ids = start.prompt + start.resp
        width = max(self.P, len(ids))
        room = min(self.R, self.r.cache.max_len - width, job.max_tokens)
        if room < 1:
            self.waiting.remove(job)
            job.session.overflowed = True
            self.outbox.append((job.call, ApiError(
                f"the session is {len(ids)} tokens long; with the {self.R}-token response budget the engine holds "
                f"{self.r.cache.max_len - 1}: context length exceeded "
                "(raise data.max_prompt_length / data.max_response_length)")))
            return False
        slots = self._take_slots(job.params.n)
        if slots is None:
            return False
        job.branches = [start] + [Branch(list(start.prompt), list(start.resp), list(start.mask), list(start.logp),
                                         (), start.gen_start, list(start.turn_ends), start.root)
                                  for _ in range(job.params.n - 1)]
        job.slots = slots
        for s in slots:
            self.info[s] = SlotInfo(width, len(start.resp), len(ids), None, next(self._clock))
            self.live[s], self.host_steps[s], self.cap[s], job.start[s] = job, 1, room, 0
            self.since[s] = self.chunks
        prefill.setdefault((width, room), []).append((job, ids))
        return True

    def _prefill(self, width: int, room: int, group: list[tuple[Job, list[int]]]) -> None:
        ids_t = torch.full((len(group), width), self.r.pad_id, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for i, (_, ids) in enumerate(group):
            ids_t[i, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            mask[i, width - len(ids):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        n = group[0][0].params.n
        dev = self.r.device
        self.r.admit([s for job, _ in group for s in job.slots], to_device(ids_t, dev), to_device(mask, dev),
                     to_device(pos, dev), n,
                     [x for job, _ in group for x in job.seeds], room)
        self.stats["prefills"] += 1
        self.stats["prefilled"] += len(group)
        now = time.monotonic()
        self.prefill_at.append(now - self.t_start)
        for job, _ in group:
            job.call.admitted = now
        self.stats["prefill_tokens"] += sum(len(ids) for _, ids in group)

    def _extend(self, items: list[tuple[Job, int, list[int], int]]) -> None:
        by_width: dict[int, list[tuple[Job, int, list[int], int]]] = {}
        for it in items:
            by_width.setdefault(self.info[it[1]].width, []).append(it)
        for width, group in by_width.items():
            caps = [min(self.R, self.r.cache.max_len - width, step + len(new_ids) + job.max_tokens)
                    for job, _, new_ids, step in group]  # extend_many sets them on the device
            lengths = self.r.extend_many([(s, new, self.info[s].pos0) for _, s, new, _ in group], width,
                                         steps=[st for *_, st in group], max_new=caps)
            self.stats["extends"] += 1
            now = time.monotonic()
            for (job, s, new_ids, step), cap, length in zip(group, caps, lengths):
                self.info[s].used = next(self._clock)
                self.live[s], self.host_steps[s], self.cap[s] = job, length, cap
                self.since[s] = self.chunks
                job.start[s] = step + len(new_ids)
                job.session.extended += 1
                job.call.admitted = now
                self.stats["extended"] += 1
                self.stats["extend_tokens"] += len(new_ids) + 1

    # -------------------------------------------------------------------------------------------------- decode
    def _decode(self) -> None:
        """Queue the next decode chunk and a readout after it, then act on the oldest readout: with `overlap` the
        one of the chunk before (the new chunk runs meanwhile), else this one. A slot admitted after a readout was
        queued (`since`) is not described by it: its `done` there is the previous job's."""
        r = self.r
        remaining = max(self.cap[s] - self.host_steps[s] for s in self.live)
        todo = min(self.check_every, remaining)
        if todo > 0:
            kv_needed = max(self.info[s].width + self.host_steps[s] for s in self.live) + todo - 1
            t0 = time.monotonic()
            b, L = r.shape(max(self.live), remaining, kv_needed)
            for _ in range(todo):
                r.step_(b, L)
            self.phase_s["launch"] += time.monotonic() - t0
            self.stats["decode_steps"] += todo
            self.stats["live_row_steps"] += todo * len(self.live)
            self.stats["step_rows"] += todo * b
            for s in self.live:
                self.host_steps[s] += todo
        self.pending.append((self.chunks, r.readout()))
        self.chunks += 1
        if self.overlap and todo > 0 and len(self.pending) == 1:
            return  # the first chunk in flight: its readout is read after the next chunk is queued
        if not self.overlap or todo == 0:
            del self.pending[:-1]  # the newest readout says all the older ones do
        chunk, readout = self.pending.pop(0)
        t0 = time.monotonic()
        done, steps_now = (x.numpy() for x in readout.wait()[0])
        self.phase_s["sync"] += time.monotonic() - t0
        finished = [s for s in self.live if done[s] and self.since[s] <= chunk]
        if not finished and todo == 0:
            raise RuntimeError(f"agent scheduler made no progress: slots {sorted(self.live)} not done at their cap")
        if finished:
            t0 = time.monotonic()
            toks, logps = r.finished_rows(finished, int(max(steps_now[s] for s in finished)), readout)
            for i, s in enumerate(finished):
                job = self.live.pop(s)
                a, b = job.start[s], int(steps_now[s])
                job.out[s] = (toks[i][a:b], logps[i][a:b])
                del self.host_steps[s], self.since[s]
                if len(job.out) == len(job.slots):
                    self._answer(job)
            self.phase_s["answer"] += time.monotonic() - t0
        if not self.live:
            self.pending.clear()

    def _answer(self, job: Job) -> None:
        choices = []
        stop_ids = set(job.params.stop_token_ids) | (set() if job.params.ignore_eos else set(self.eos_ids))
        new_branches = []
        for s, branch in zip(job.slots, job.branches):
            ids, lps = job.out[s]
            ids, lps, text, reason = self._cut(ids, lps, job.stops, stop_ids)
            message = None
            if job.call.kind == "chat":
                content, calls, malformed = split_tool_calls(text) if job.parse_tools else (text, None, False)
                job.session.malformed_tool_calls += int(malformed)
                job.session.last_malformed = malformed
                message = {"role": "assistant", "content": content or None}
                if calls:
                    message["tool_calls"] = calls
                names = {c["function"]["name"] for c in calls or []}
                self.stats["tool_choice_unmet"] += int(job.require is not None and (
                    not names or (job.require != "*" and names != {job.require})))
            branch.add_sampled(ids, lps, job.plan.messages + ((normalize(message),) if message else ()))
            info = self.info[s]
            info.owner, branch.slot = branch, s
            new_branches.append(branch)
            top = None
            if job.top and ids:
                temperature = job.params.temperature if job.params.do_sample else 1.0  # as the sampler's log-probs
                top = [[(self.tok.decode([t]), lp) for t, lp in alts] for alts in top_logprobs(
                    self.r, branch.prompt + branch.resp, len(ids), job.top, temperature)]
            tokens = [self.tok.decode([t]) for t in ids] if job.logprobs else []  # only the log-probs show them
            choices.append(Choice(text, ids, lps, tokens, reason, message, top))
        stale = [s for s, info in self.info.items() if s not in self.live and info.owner is not None
                 and any(info.owner is b for b in job.session.branches)]
        for s in stale:
            self._release(s)
        job.session.branches = new_branches
        prompt_tokens = len(job.branches[0].prompt) + job.branches[0].gen_start
        build = chat_response if job.call.kind == "chat" else completion_response
        self.outbox.append((job.call, build(str(job.call.body.get("model", "policy")), choices, prompt_tokens,
                                            job.logprobs)))

    def _send(self) -> None:
        if self.outbox:
            reply_all(self.outbox)
            self.outbox = []

    def _cut(self, ids: list[int], lps: list[float], stops: list[str], stop_ids: set[int]
             ) -> tuple[list[int], list[float], str, str]:
        """(ids, log-probs, text, finish_reason) with a `stop` string applied: the ids end with the one that
        completes the string, the text ends before it."""
        text = self.tok.decode(ids, skip_special_tokens=True)
        hits = [(text.find(s), s) for s in stops if s and s in text]
        if hits:
            at, _ = min(hits)
            k = next(k for k in range(1, len(ids) + 1)
                     if any(s in self.tok.decode(ids[:k], skip_special_tokens=True) for _, s in hits))
            return ids[:k], lps[:k], text[:at], "stop"
        return ids, lps, text, "stop" if ids and ids[-1] in stop_ids else "length"

    def _abort(self, why: str) -> None:
        for job in {id(j): j for j in [*self.live.values(), *self.waiting]}.values():
            self.outbox.append((job.call, ApiError(why, 503)))
        for s in list(self.live):
            self.info.pop(s, None)
            heapq.heappush(self.free, s)
        self.live.clear()
        self.since.clear()
        self.pending.clear()
        self.waiting.clear()

    def metrics(self) -> dict[str, float]:
        st = self.stats
        return {"agent/requests": st["requests"], "agent/extended_requests": st["extended"],
                "agent/extend_tokens": st["extend_tokens"], "agent/prefilled_requests": st["prefilled"],
                "agent/prefill_tokens": st["prefill_tokens"],
                "agent/kv_evictions": st["evictions"], "agent/bad_requests": st["bad_requests"],
                "agent/tool_choice_unmet": st["tool_choice_unmet"],
                "rollout/decode_steps": st["decode_steps"], "rollout/prefills": st["prefills"],
                "agent/engine_idle_s": st["idle_s"], "agent/extends": st["extends"],
                "agent/extend_rows_per_call": st["extended"] / max(st["extends"], 1),
                "agent/prefill_rows_per_call": st["prefilled"] / max(st["prefills"], 1),
                "agent/live_rows_per_step": st["live_row_steps"] / max(st["decode_steps"], 1),
                "agent/step_rows": st["step_rows"] / max(st["decode_steps"], 1),
                "agent/first_prefill_ms": 1e3 * self.prefill_at[0] if self.prefill_at else 0.0,
                "agent/last_prefill_ms": 1e3 * self.prefill_at[-1] if self.prefill_at else 0.0,
                "agent/first_arrival_ms": 1e3 * min(self.first_arrivals, default=0.0),
                "agent/last_first_arrival_ms": 1e3 * max(self.first_arrivals, default=0.0)} | {
                f"agent/loop_{k}_s": v for k, v in self.phase_s.items()}
