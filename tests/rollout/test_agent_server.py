"""rollout.agent.mode=server: agents with the real `openai` client against the real endpoint over a tiny random
model — several turns in parallel sessions batched together, KV extension, token-exact trajectories (also where
re-tokenising the chat would give other ids), history edits, failures counted, the environment adapter."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pickle
import queue
import re
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("openai")  # a dependency (pyproject); absent on machines that run only the GPU paths
pytest.importorskip("aiohttp")

from rollout_helpers import make_model, rollout_cfg
from test_rollout_engine import hf_logprobs

from hybridflow.agentic.agent_session import Session, as_dict, normalize
from hybridflow.agentic.agents import AgentResult, Environment, EnvStep, HttpClients
from hybridflow.agentic.endpoint_process import Endpoint
from hybridflow.agentic.openai_api import (
    ApiError,
    Call,
    OpenAIServer,
    reply_all,
    split_tool_calls,
    tool_choice,
)
from hybridflow.config import load_config
from hybridflow.models.tokenizer import builtin_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.rollout import RolloutEngine, agent_scheduler
from hybridflow.rollout.agent_scheduler import AgentScheduler
from hybridflow.rollout.sampling import SamplingParams

P, R = 24, 160
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
SEEN: dict[str, list[dict]] = {}  # session -> what the agent got back, per request


def _sid(client) -> str:
    return str(client.base_url).rstrip("/").split("/")[-2]


async def _ask(client, messages, **kw):
    r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=kw.pop("max_tokens", 5),
                                             **kw)
    SEEN.setdefault(_sid(client), []).append({"ids": [c.model_extra["token_ids"] for c in r.choices],
                                              "logprobs": [[t.logprob for t in c.logprobs.content]
                                                           if c.logprobs else None for c in r.choices]})
    return r


async def chat_agent(client, sample):
    """Three turns with tools offered; each answer is followed by a tool result (with trailing spaces)."""
    messages = [{"role": "user", "content": f"q{sample['idx']}"}]
    for turn in range(3):
        r = await _ask(client, messages, tools=TOOLS, logprobs=True)
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        if turn < 2:
            messages.append({"role": "tool", "tool_call_id": "x", "content": f"{turn}   "})
    return AgentResult(reward=1.0, turn_rewards=[0.1, 0.2, 0.3], messages=messages)


def _engine(model, chat_template=None, timeout_s=30.0, workers=1, path=__file__, **kw):
    agent = dataclasses.replace(load_config([], []).rollout.agent, mode="server", path=str(path), name="chat_agent",
                                timeout_s=timeout_s, workers=workers)
    cfg = rollout_cfg(agent=agent, kv_cache_tokens=8192, free_cache_engine=False, **kw)
    eng = RolloutEngine(model, cfg, eos_token_id=1, pad_token_id=0, max_prompt_length=P, max_response_length=R,
                        tokenizer=builtin_tokenizer(), chat_template=chat_template)
    assert eng.agent.agent.__qualname__ == "chat_agent"  # loaded from rollout.agent.path (a copy of this module)
    if workers == 1:
        eng.agent.agent = chat_agent  # this module's, so SEEN is the dict the tests read
    return eng


def _prompts(B: int, n: int = 1) -> DataProto:
    ids = torch.full((B, 4), 5)
    out = DataProto.from_single_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    out.non_tensor_batch = {"idx": np.arange(B, dtype=object)}
    out.meta_info = {"n": n}
    return out


@pytest.fixture(scope="module")
def model():
    return make_model("tiny")


@pytest.fixture(scope="module")
def engine(model):
    torch.set_num_threads(1)
    eng = _engine(model, max_num_seqs=16)
    yield eng
    eng.close()


def _sampled(out: DataProto, row: int) -> list[int]:
    b = out.batch
    return b["responses"][row][b["response_mask"][row].bool()].tolist()


@pytest.mark.parametrize("overlap", [True, False])
def test_parallel_multi_turn_sessions_are_batched_and_token_exact(engine, model, overlap):
    """Also with the serving loop's host work overlapping the next decode chunk (the default): readouts queued
    before a slot's re-admission must not finish its new request."""
    SEEN.clear()
    saved = engine.agent.cfg
    engine.agent.cfg = dataclasses.replace(saved, overlap=overlap)
    try:
        out = engine.generate(_prompts(3, n=2))
    finally:
        engine.agent.cfg = saved
    m = out.meta_info["metrics"]
    assert m["agent/tasks"] == 6 and m["agent/errors"] == 0 and m["agent/requests"] == 18, m
    # every later turn extended its session's cached tokens: one prefill per session, the rest appended
    assert m["agent/prefilled_requests"] == 6 and m["agent/extended_requests"] == 12, m
    assert m["rollout/prefills"] <= 6, m  # first requests arriving together share one forward
    assert m["rollout/decode_steps"] < 18 * 5 / 2, m  # the sessions decoded together, not one after another
    # where the time went: forward calls and their rows, rows per decode step, the requests' latencies
    assert 1 <= m["agent/extends"] <= 12 and m["agent/extend_rows_per_call"] == 12 / m["agent/extends"], m
    assert m["agent/prefill_rows_per_call"] == 6 / m["rollout/prefills"], m
    assert 1 <= m["agent/live_rows_per_step"] <= 6, m
    assert m["agent/turn_gap_ms"] > 0 and m["agent/answer_ms"] > 0 and m["agent/queued_ms"] >= 0, m
    assert 0 <= m["agent/engine_idle_s"] < 30, m
    # the call's timeline, one clock: tasks start, then their first requests reach the endpoint, then prefill
    assert 0 < m["agent/first_task_start_ms"] <= m["agent/last_task_start_ms"], m
    assert m["agent/first_task_start_ms"] < m["agent/first_arrival_ms"] <= m["agent/last_first_arrival_ms"], m
    assert m["agent/first_arrival_ms"] < m["agent/first_prefill_ms"], m
    b = out.batch
    for row in range(6):
        sid = f"r{engine.agent.calls}-{row // 2}-{row % 2}"
        got = [x for req in SEEN[sid] for x in req["ids"][0]]
        assert _sampled(out, row) == got  # the trajectory trains on exactly what was sampled
        served_lp = [x for req in SEEN[sid] for x in req["logprobs"][0]]
        assert torch.allclose(b["rollout_log_probs"][row][b["response_mask"][row].bool()],
                              torch.tensor(served_lp), atol=1e-6)
        ends = b["turn_rewards"][row].nonzero().flatten().tolist()
        assert len(ends) == 3 and all(b["response_mask"][row, e] == 1 for e in ends)
        assert torch.allclose(b["turn_rewards"][row][ends], torch.tensor([0.1, 0.2, 1.3]))
    # the KV reused across turns gives the log-probs of one plain forward over the whole trajectory
    assert torch.allclose(hf_logprobs(model, out, 1.0), b["rollout_log_probs"], atol=2e-4)


def test_replies_go_to_the_endpoint_in_one_message():
    """The answers of one decode chunk reach the endpoint in one message; the endpoint skips an answer whose client
    went away, and an ApiError keeps its status across the pipe."""
    sent = []
    calls = [Call("completion", f"s{i}", {}, rid=i + 1, replies=sent.append) for i in range(3)]
    calls[1].admitted = 5.0
    reply_all([(calls[0], {"ok": 0}), (calls[1], ApiError("busy", 503)), (calls[2], {"ok": 2})])
    assert len(sent) == 1 and [item[0] for item in sent[0]] == [1, 2, 3]
    assert all(c.answered > 0 for c in calls) and sent[0][1][2] == 5.0
    err = pickle.loads(pickle.dumps(sent[0][1][1]))
    assert isinstance(err, ApiError) and err.status == 503 and str(err) == "busy"
    loop = asyncio.new_event_loop()
    try:
        ep = Endpoint(None, None, "policy")
        futs = {rid: loop.create_future() for rid in (1, 2, 3)}
        ep.pending = dict(futs)
        futs[3].cancel()  # its agent timed out
        ep._set_results(sent[0])
        assert futs[1].result()[0] == {"ok": 0} and isinstance(futs[2].result()[0], ApiError)
        assert not ep.pending
    finally:
        loop.close()
    reply_all([(Call("completion", "late", {}), {"ok": 3})])  # nobody holds it open: dropped, no error


def test_endpoint_process_serves_and_stops():
    """The endpoint runs in a process of its own: requests reach the engine's inbox over the pipe, answers come
    back to the client; between rollouts it answers 503 itself; Ctrl-C (SIGINT) does not stop it (the trainer's
    graceful stop needs it for the step in flight); latency metrics come back on request; close stops it."""
    import httpx

    server = OpenAIServer()
    try:
        url = server.session_url("a") + "/completions"
        assert httpx.post(url, json={"prompt": [1]}, timeout=10).status_code == 503  # not serving

        async def ask():
            async with httpx.AsyncClient(timeout=10) as c:
                return await c.post(url, json={"prompt": [1, 2]})
        server.set_serving(True)
        os.kill(server._proc.pid, signal.SIGINT)
        fut = server.run(ask())
        call = server.calls.get(timeout=10)
        assert (call.kind, call.session, call.body) == ("completion", "a", {"prompt": [1, 2]})
        assert 0 < call.arrived <= time.monotonic()
        call.admitted = time.monotonic()
        call.reply({"choices": [], "object": "text_completion"})
        resp = fut.result(timeout=10)
        assert resp.status_code == 200 and resp.json()["object"] == "text_completion"
        fut = server.run(ask())
        server.calls.get(timeout=10).reply(ApiError("bad prompt"))
        assert fut.result(timeout=10).status_code == 400
        fut = server.run(ask())
        deadline = time.monotonic() + 10
        while server.calls.empty() and time.monotonic() < deadline:  # forwarded, not yet taken by the engine
            time.sleep(0.01)
        server.set_serving(False)  # answers it 503
        assert fut.result(timeout=10).status_code == 503
        m = server.take_latency()
        assert m["agent/answer_ms"] > 0 and m["agent/queued_ms"] > 0, m
        with pytest.raises(queue.Empty):
            server.calls.get_nowait()
        proc = server._proc
    finally:
        t0 = time.monotonic()
        server.close()
    assert proc.poll() is not None and time.monotonic() - t0 < 10 and not server.alive


UNGUARDED = """
import sys
sys.path[:0] = {paths!r}
from hybridflow.agentic.openai_api import OpenAIServer
print("main ran", flush=True)
server = OpenAIServer()
server.close()
"""


def test_endpoint_start_does_not_rerun_the_users_script(tmp_path):
    """A script without an `if __name__ == "__main__":` guard (the README's Python API example) runs once: the
    endpoint's process is not started by re-importing `__main__`."""
    import subprocess

    script = tmp_path / "train.py"
    script.write_text(UNGUARDED.format(paths=[p for p in sys.path if p]))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("main ran") == 1, out.stdout


class _Wave:
    """Requests of one wave: each next one arrives while the engine is taking the earlier ones."""

    def __init__(self, calls: list[Call]) -> None:
        self.calls = calls

    def empty(self) -> bool:
        return True  # nothing there yet when looked at

    def get(self, timeout: float | None = None) -> Call:
        if not self.calls:
            raise queue.Empty
        return self.calls.pop(0)

    def get_nowait(self) -> Call:
        raise queue.Empty


def test_idle_engine_gathers_a_wave_before_admitting():
    runner = SimpleNamespace(R=16, cache=SimpleNamespace(slots=4))
    sched = AgentScheduler(runner, builtin_tokenizer(), None, SamplingParams(), eos_ids=[1], prompt_width=4,
                           check_every=1, seed=0)
    wave = [Call("completion", f"s{i}", {"prompt": [5, 6 + i]}) for i in range(3)]
    sched._take(_Wave(list(wave)), block=True)
    assert [job.call for job in sched.waiting] == wave  # admitted in one forward, not one per arrival


def test_agent_http_clients_are_kept_across_calls(engine):
    """Each running task leases its own HTTP client; finished tasks hand theirs to the next tasks and calls, so a
    call's first requests reuse open connections (agents.HttpClients)."""
    engine.generate(_prompts(3, n=2))
    kept = {id(c) for _, c in engine.agent.clients.free}
    assert len(kept) >= 6  # six tasks ran at once: six clients (or more kept from earlier calls), now idle
    out = engine.generate(_prompts(3, n=2))
    assert out.meta_info["metrics"]["agent/errors"] == 0
    assert {id(c) for _, c in engine.agent.clients.free} == kept  # the same six served the second call


def test_http_client_leases():
    async def go():
        clients = HttpClients()
        async with clients.lease(5.0) as a, clients.lease(5.0) as b:
            assert a is not b  # concurrent tasks never share a client
        async with clients.lease(5.0) as c:
            assert c in (a, b)
        async with clients.lease(9.0) as d:  # another timeout: its own client
            assert d not in (a, b)
        assert len(clients.free) == 3
        async with clients.lease(5.0) as e:
            await e.aclose()  # an agent closed its client (`await client.close()`): never handed out again
        async with clients.lease(5.0) as f:
            assert f is not e and not f.is_closed
        assert a._transport._pool._keepalive_expiry >= 600  # connections outlive a training step between calls
        await clients.aclose()
        assert not clients.free and a.is_closed and d.is_closed
    asyncio.run(go())


class _Spread:
    """Requests that arrive `gap` seconds apart on a simulated clock: a wait shorter than the gap finds nothing, a
    longer one advances the clock by the gap."""

    def __init__(self, calls: list[Call], gap: float) -> None:
        self.calls, self.gap, self.now = calls, gap, 100.0

    def monotonic(self) -> float:
        return self.now

    def get(self, timeout: float | None = None) -> Call:
        if not self.calls or (timeout is not None and timeout < self.gap):
            raise queue.Empty
        self.now += self.gap
        call = self.calls.pop(0)
        call.arrived = self.now
        return call

    def get_nowait(self) -> Call:
        raise queue.Empty


@pytest.mark.parametrize("expected", [0, 3, 4])
def test_first_wave_is_gathered_until_every_session_has_asked(expected, monkeypatch):
    """Sessions' first requests 10 ms apart: past the 3 ms gather window, but the call's first wave (`sessions` =
    the agent tasks running at the start) is taken whole while sessions that have not asked yet remain; unknown
    (0): as before. A second request of a session already seen does not stretch the wave."""
    monkeypatch.setattr(agent_scheduler, "GATHER_S", 0.003)
    monkeypatch.setattr(agent_scheduler, "FIRST_WAVE_GAP_S", 0.05)
    wave = [Call("completion", f"s{i}", {"prompt": [5, 6 + i]}) for i in range(4)]
    wave.insert(1, Call("completion", "s0", {"prompt": [5, 6, 7]}))
    spread = _Spread(list(wave), gap=0.01)
    monkeypatch.setattr(agent_scheduler, "time", SimpleNamespace(monotonic=spread.monotonic))
    runner = SimpleNamespace(R=16, cache=SimpleNamespace(slots=4))
    sched = AgentScheduler(runner, builtin_tokenizer(), None, SamplingParams(), eos_ids=[1], prompt_width=4,
                           check_every=1, seed=0, sessions=expected)
    sched._take(spread, block=True)
    # expected 3: the third session's request completes the wave; the fourth (an unexpected one) waits
    assert [job.call for job in sched.waiting] == wave[:{0: 1, 3: 4, 4: 5}[expected]]


async def edit_agent(client, sample):
    """Turn 2 resends the conversation with turn 1's answer edited: the session cannot be extended."""
    messages = [{"role": "user", "content": "hello"}]
    r = await _ask(client, messages)
    messages += [{"role": "assistant", "content": r.choices[0].message.content + "!"},
                 {"role": "user", "content": "and?"}]
    await _ask(client, messages)
    return AgentResult(messages=messages)


def test_token_exact_where_retokenising_differs(model):
    """A template that strips whitespace: re-rendering the chat would drop the tool result's trailing spaces
    and re-split the turns; the trajectory keeps the ids that were sampled and appended."""
    template = builtin_tokenizer().chat_template.replace("{{ m['content'] }}", "{{ m['content'] | trim }}")
    eng = _engine(model, chat_template=template, max_num_seqs=4)
    try:
        SEEN.clear()
        out = eng.generate(_prompts(1))
        sid = f"r{eng.agent.calls}-0-0"
        session = next(iter(eng.agent.last_sessions.values()))
        branch = session.branches[0]
        msgs = [as_dict(m) for m in branch.messages]
        retok = builtin_tokenizer().apply_chat_template(msgs, chat_template=template, tokenize=True)
        b = out.batch
        traj = b["input_ids"][0][b["attention_mask"][0].bool()].tolist()
        assert traj == branch.prompt + branch.resp
        assert retok != traj[: len(retok)]  # re-tokenising would have changed the ids...
        assert _sampled(out, 0) == [x for req in SEEN[sid] for x in req["ids"][0]]  # ...we train on the sampled
        assert "<tool_response>0</tool_response>" in builtin_tokenizer().decode(traj)  # appended via the template

        eng.agent.agent = edit_agent
        SEEN.clear()
        out = eng.generate(_prompts(1))
        m = out.meta_info["metrics"]
        assert m["agent/rewritten_sessions"] == 1 and m["agent/extended_requests"] == 0, m
        first, second = SEEN[f"r{eng.agent.calls}-0-0"]
        assert m["agent/dropped_tokens"] == len(first["ids"][0])
        assert _sampled(out, 0) == second["ids"][0]  # the edited history is context; only sampled ids train
    finally:
        eng.close()


async def flaky_agent(client, sample):
    i = sample["idx"]
    if i == 0:
        raise RuntimeError("agent bug")
    if i == 1:
        await _ask(client, [{"role": "user", "content": "hi"}])
        await asyncio.sleep(60)
    if i == 2:
        r = await _ask(client, [{"role": "user", "content": "hi"}])
        await _ask(client, [{"role": "user", "content": "hi"}, r.choices[0].message.model_dump(exclude_none=True),
                            {"role": "user", "content": "x" * R}])  # outgrows the context: HTTP 400
    await _ask(client, [{"role": "user", "content": "hi"}])
    return 0.5


async def broken_agent(client, sample):
    raise ValueError(f"broken on {sample['idx']}")


def test_failures_are_counted_and_never_hang(engine):
    engine.agent.cfg = dataclasses.replace(engine.agent.cfg, timeout_s=2.0)
    try:
        SEEN.clear()
        engine.agent.agent = flaky_agent
        t0 = time.perf_counter()
        out = engine.generate(_prompts(4))
        assert time.perf_counter() - t0 < 20
        m = out.meta_info["metrics"]
        assert (m["agent/errors"], m["agent/timeouts"]) == (2, 1), m
        b = out.batch
        assert (b["response_mask"][:2] == 0).all()  # failed tasks train on nothing...
        # ...but a session that outgrew the context trains on what it sampled
        assert m["agent/context_overflows"] == 1 and _sampled(out, 2) == SEEN[f"r{engine.agent.calls}-2-0"][0]["ids"][0]
        assert b["response_mask"][3].sum() > 0 and b["turn_rewards"][3].sum() == 0.5
        engine.agent.agent = broken_agent
        with pytest.raises(RuntimeError, match="every agent task failed.*ValueError: broken on 0"):
            engine.generate(_prompts(2))
    finally:
        engine.agent.cfg = dataclasses.replace(engine.agent.cfg, timeout_s=30.0)
        engine.agent.agent = chat_agent


async def completions_agent(client, sample):
    """/v1/completions: n, stop, logprobs; greedy twice gives the same ids; a token-id prompt extends."""
    r = await client.completions.create(model="policy", prompt="User: hi\nAssistant:", n=3, max_tokens=8,
                                        logprobs=1, stop=["a", "e"])
    assert len(r.choices) == 3 and all(len(c.logprobs.token_logprobs) == len(c.model_extra["token_ids"])
                                       for c in r.choices)
    assert not any("a" in c.text or "e" in c.text for c in r.choices)
    g1 = await client.completions.create(model="policy", prompt="User: x\nAssistant:", max_tokens=6, temperature=0)
    g2 = await client.completions.create(model="policy", prompt="User: x\nAssistant:", max_tokens=6, temperature=0)
    assert g1.choices[0].model_extra["token_ids"] == g2.choices[0].model_extra["token_ids"]
    ids = builtin_tokenizer().encode("User: x\nAssistant:") + g2.choices[0].model_extra["token_ids"] + [5, 6]
    r = await client.completions.create(model="policy", prompt=ids, max_tokens=4)
    SEEN["last"] = [ids, r.choices[0].model_extra["token_ids"]]
    return None


def test_completions_endpoint(engine):
    engine.agent.agent = completions_agent
    try:
        out = engine.generate(_prompts(1))
    finally:
        engine.agent.agent = chat_agent
    m = out.meta_info["metrics"]
    assert m["agent/errors"] == 0 and m["agent/extended_requests"] == 1, m  # the token-id prompt extended
    ids, sampled = SEEN["last"]
    b = out.batch
    assert b["input_ids"][0][b["attention_mask"][0].bool()].tolist() == ids + sampled


def test_eviction_keeps_trajectories_exact(model):
    """4 sessions on 2 KV slots: idle sessions are evicted and re-prefilled from their recorded ids."""
    eng = _engine(model, max_num_seqs=2)
    try:
        SEEN.clear()
        out = eng.generate(_prompts(4))
    finally:
        eng.close()
    m = out.meta_info["metrics"]
    assert m["agent/kv_evictions"] > 0 and m["agent/errors"] == 0, m
    for row in range(4):
        assert _sampled(out, row) == [x for req in SEEN[f"r1-{row}-0"] for x in req["ids"][0]]
    assert torch.allclose(hf_logprobs(model, out, 1.0), out.batch["rollout_log_probs"], atol=2e-4)


class CountdownEnv(Environment):
    """Two turns; each answer gets a tool result and reward 1 on the second."""

    tools = TOOLS

    def reset(self, sample):
        self.turn = 0
        return [{"role": "user", "content": f"go {sample['idx']}"}]

    def step(self, message):
        self.turn += 1
        return EnvStep([{"role": "tool", "content": "7"}], reward=float(self.turn == 2), done=self.turn == 2)


def test_environment_adapter(engine):
    from hybridflow.agentic.agents import EnvironmentAgent

    engine.agent.agent = EnvironmentAgent(CountdownEnv, max_tokens=4).run
    try:
        out = engine.generate(_prompts(2))
    finally:
        engine.agent.agent = chat_agent
    m = out.meta_info["metrics"]
    assert m["agent/requests"] == 4 and m["agent/extended_requests"] == 2, m
    rewards = out.batch["turn_rewards"]
    assert (rewards.sum(-1) == 1.0).all() and ((rewards != 0).sum(-1) == 1).all()


def test_tool_calls_and_message_matching():
    content, calls, bad = split_tool_calls('ok <tool_call>{"name": "calculator", "arguments": {"e": "1+2"}}'
                                           '</tool_call>')
    assert (content, bad, calls[0]["function"]["name"]) == ("ok", False, "calculator")
    assert split_tool_calls("<tool_call>{oops</tool_call>")[1:] == (None, True)
    # a client echoes the call with its own id and arguments as a string: same message
    sent = {"role": "assistant", "content": "ok", "tool_calls": calls}
    echoed = {"role": "assistant", "content": "ok", "tool_calls": [
        {"id": "other", "type": "function", "function": {"name": "calculator", "arguments": '{"e":"1+2"}'}}]}
    assert normalize(sent) == normalize(echoed)
    search = {"type": "function", "function": {"name": "search"}}
    assert tool_choice({"tools": [*TOOLS, search], "tool_choice": "required"}) == ("*", [*TOOLS, search])
    # a named function is the only tool the prompt shows
    assert tool_choice({"tools": [*TOOLS, search], "tool_choice": {"type": "function", "function": {"name": "search"}}}
                       ) == ("search", [search])
    s = Session()
    plan = s.plan_chat((normalize({"role": "user", "content": "q"}),), None, lambda m: [1, 2])
    assert plan.parent is None and s.rewrites == 0


def test_readme_agent_example_runs(model, tmp_path):
    """README "Train your own agent": the ~20-line agent loads from rollout.agent.path and runs against the endpoint."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    example = next(b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "rollout.agent.path" in b)
    assert len(example.strip().splitlines()) <= 25
    (tmp_path / "my_agent.py").write_text(example)
    agent = dataclasses.replace(load_config([], []).rollout.agent, mode="server", path=str(tmp_path / "my_agent.py"))
    eng = RolloutEngine(model, rollout_cfg(agent=agent, kv_cache_tokens=8192, free_cache_engine=False),
                        eos_token_id=1, pad_token_id=0, max_prompt_length=P, max_response_length=R,
                        tokenizer=builtin_tokenizer())
    prompts = _prompts(2)
    prompts.non_tensor_batch["raw_prompt"] = np.array([[{"role": "user", "content": "1+2?"}]] * 2, dtype=object)
    try:
        m = eng.generate(prompts).meta_info["metrics"]
    finally:
        eng.close()
    assert m["agent/errors"] == 0 and m["agent/tasks"] == 2, m


def test_tool_calculator_agent_calls_the_tool():
    """The example agent with the committed SFT checkpoint: the model's Hermes calls come back as `tool_calls`, the
    agent runs them, the results extend the sessions, and the greedy answers copy them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = Path(__file__).resolve().parents[2]
    ckpt = root / "tests" / "assets" / "sft_tool_calculator"
    tok = AutoTokenizer.from_pretrained(ckpt)
    agent = dataclasses.replace(load_config([], []).rollout.agent, mode="server",
                                path=str(root / "examples" / "agents" / "tool_calculator.py"))
    eng = RolloutEngine(AutoModelForCausalLM.from_pretrained(ckpt).eval(),
                        rollout_cfg(agent=agent, kv_cache_tokens=8192, free_cache_engine=False, do_sample=False),
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_prompt_length=32,
                        max_response_length=240, tokenizer=tok)
    questions = {"What is 408*99?": 40392, "What is 731*52?": 38012, "What is 250*64?": 16000}
    prompts = _prompts(len(questions))
    prompts.non_tensor_batch["raw_prompt"] = np.array([[{"role": "user", "content": q}] for q in questions],
                                                      dtype=object)
    try:
        out = eng.generate(prompts)
    finally:
        eng.close()
    m = out.meta_info["metrics"]
    assert m["agent/errors"] == 0 and m["agent/extended_requests"] >= 2, m  # tool results appended to sessions
    texts = [tok.decode(r[a.bool()]) for r, a in zip(out.batch["responses"], out.batch["attention_mask"][:, 32:])]
    right = [f"<tool_response>{v}</tool_response>" in t and t.endswith(f"#### {v}<|endoftext|>")
             for t, v in zip(texts, questions.values())]
    assert sum(right) >= 2, texts


def test_agent_config_errors_name_the_key_and_the_fix():
    with pytest.raises(ValueError, match=r"rollout.agent.path=None: rollout.agent.mode=server needs the agent"):
        load_config([], ["rollout.agent.mode=server"])
    with pytest.raises(ValueError, match=r"rollout.agent.mode='server'.*set rollout.multi_turn.enable=false"):
        load_config([], ["rollout.agent.mode=server", "rollout.agent.path=a.py", "rollout.multi_turn.enable=true",
                         "rollout.multi_turn.tools=[calculator]"])
    with pytest.raises(ValueError, match=r"rollout.agent.name='nope'.*async def nope"):
        _engine_with(make_model("tiny"), name="nope")


def _engine_with(model, **agent_kw):
    agent = dataclasses.replace(load_config([], []).rollout.agent, mode="server", path=__file__, **agent_kw)
    return RolloutEngine(model, rollout_cfg(agent=agent, kv_cache_tokens=8192), eos_token_id=1, pad_token_id=0,
                         max_prompt_length=P, max_response_length=R, tokenizer=builtin_tokenizer())


async def branch_agent(client, sample):
    """n=2, then the conversation goes on from the second choice: that branch is extended and is the row."""
    messages = [{"role": "user", "content": "pick"}]
    r = await _ask(client, messages, n=2)
    messages += [r.choices[1].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
    r2 = await _ask(client, messages)
    return AgentResult(messages=[*messages, r2.choices[0].message.model_dump(exclude_none=True)])


def test_n_choices_then_continue_from_one(engine):
    SEEN.clear()
    engine.agent.agent = branch_agent
    try:
        out = engine.generate(_prompts(1))
    finally:
        engine.agent.agent = chat_agent
    m = out.meta_info["metrics"]
    assert m["agent/errors"] == 0 and m["agent/extended_requests"] == 1, m
    first, second = SEEN[f"r{engine.agent.calls}-0-0"]
    assert _sampled(out, 0) == first["ids"][1] + second["ids"][0]


async def stream_agent(client, sample):
    """`stream=True` on both endpoints with the client's streaming API; the streamed turn is echoed back and extended."""
    text, comp_ids = "", []
    async for chunk in await client.completions.create(model="policy", prompt="User: x\nAssistant:", max_tokens=5,
                                                       stream=True):
        text += "".join(c.text for c in chunk.choices)
        comp_ids += [t for c in chunk.choices for t in (c.model_extra or {}).get("token_ids") or []]
    messages = [{"role": "user", "content": "hi"}]  # a new root: the row is this chat
    stream = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=6,
                                                  logprobs=True, stream=True, stream_options={"include_usage": True})
    content, calls, finish, usage, ids = "", {}, None, None, []
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            content += c.delta.content or ""
            ids += (c.model_extra or {}).get("token_ids") or []
            for tc in c.delta.tool_calls or []:
                calls[tc.index] = {"id": tc.id, "type": "function",
                                   "function": {"name": tc.function.name, "arguments": tc.function.arguments}}
            finish = c.finish_reason or finish
    message = {"role": "assistant", "content": content, **({"tool_calls": list(calls.values())} if calls else {})}
    messages += [message, {"role": "tool", "tool_call_id": "x", "content": "3"}]
    r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=4)
    SEEN[_sid(client)] = [ids, usage.completion_tokens, calls, finish, text, comp_ids]
    return AgentResult(messages=[*messages, r.choices[0].message.model_dump(exclude_none=True)])


def test_streaming_with_the_openai_client(engine, monkeypatch):
    """Whole completions streamed as SSE chunks then [DONE]: content, token ids, usage and tool calls (in the last
    chunk of a choice) assemble in the client; the streamed answer extends the session like a plain one."""
    import hybridflow.rollout.agent_scheduler as sched

    call = [{"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"e": "1+2"}'}}]
    real = sched.split_tool_calls
    monkeypatch.setattr(sched, "split_tool_calls", lambda text: (real(text)[0], call, False))  # the tiny model
    engine.agent.agent = stream_agent  # writes no calls: every answer carries one
    try:
        out = engine.generate(_prompts(1))
    finally:
        engine.agent.agent = chat_agent
    m = out.meta_info["metrics"]
    assert m["agent/errors"] == 0 and m["agent/extended_requests"] == 1, m
    ids, completion_tokens, calls, finish, text, comp_ids = SEEN[f"r{engine.agent.calls}-0-0"]
    assert 1 <= len(ids) == completion_tokens <= 6 and _sampled(out, 0)[: len(ids)] == ids
    assert calls == {0: call[0]} and finish == "tool_calls"
    assert 1 <= len(comp_ids) <= 5 and text == builtin_tokenizer().decode(comp_ids, skip_special_tokens=True)


async def choice_agent(client, sample):
    """tool_choice required / named and top_logprobs through the client; malformed requests get 400."""
    import openai

    messages = [{"role": "user", "content": "hi"}]
    r = await _ask(client, messages, tools=TOOLS, tool_choice="required", logprobs=True, top_logprobs=3)
    messages.append(r.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": "again"})
    await _ask(client, messages, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "calculator"}})
    errors = []
    for kw in ({"tool_choice": "required"}, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
               {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
               {"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 2}):
        try:
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=2, **kw)
        except openai.BadRequestError as err:
            errors.append(err.message)
    SEEN["top"] = [[[(a.token, a.logprob) for a in t.top_logprobs] for t in r.choices[0].logprobs.content], errors]
    return AgentResult(messages=messages)


def test_tool_choice_and_top_logprobs(engine, model):
    """A random model writes no calls: 'required' and a named function answer 200 without tool_calls and count
    agent/tool_choice_unmet; top_logprobs give the k most likely tokens of one plain forward over the sequence."""
    SEEN.clear()
    engine.agent.agent = choice_agent
    try:
        out = engine.generate(_prompts(1))
    finally:
        engine.agent.agent = chat_agent
    m = out.meta_info["metrics"]
    assert m["agent/errors"] == 0 and m["agent/tool_choice_unmet"] == 2 and m["agent/bad_requests"] == 5, m
    top, errors = SEEN["top"]
    assert ["needs 'tools'" in errors[0], "give 'auto', 'none', 'required'" in errors[1],
            "'nope', which is not among the tools ['calculator']" in errors[2],
            "top_logprobs=21 must be in [0, 20]" in errors[3], "needs logprobs=true" in errors[4]] == [True] * 5, errors
    sid = f"r{engine.agent.calls}-0-0"
    sampled = SEEN[sid][0]["ids"][0]
    branch = engine.agent.last_sessions[sid].final()
    full = branch.prompt + branch.resp[: len(sampled)]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), -1)[len(branch.prompt) - 1: len(full) - 1]
    ref_lp, ref_ids = ref.topk(3, dim=-1)
    tok = builtin_tokenizer()
    assert [[t for t, _ in alts] for alts in top] == [[tok.decode([i]) for i in row] for row in ref_ids.tolist()]
    assert torch.allclose(torch.tensor([[lp for _, lp in alts] for alts in top]), ref_lp, atol=2e-4)
    served = SEEN[sid][0]["logprobs"][0]
    for t, alts, lp in zip(sampled, top, served):  # the sampled token, when among the top 3, has its logprob
        assert all(abs(a_lp - lp) < 2e-4 for a, a_lp in alts if a == tok.decode([t]))


POOL_AGENT = """
import os
from hybridflow.agentic.agents import AgentResult

async def chat_agent(client, sample):
    session = str(client.base_url).rstrip("/").split("/")[-2]
    with open(PIDS, "a") as f:
        f.write(f"{session} {os.getpid()}\\n")
    messages = [{"role": "user", "content": f"q{sample['idx']}"}]
    for turn in range(3):
        r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        if turn < 2:
            messages.append({"role": "user", "content": f"{turn}   "})
    return AgentResult(reward=1.0, turn_rewards=[0.1, 0.2, 0.3], messages=messages)
"""


def test_agent_tasks_in_worker_processes(model, tmp_path):
    """rollout.agent.workers=2: the tasks run in two spawned processes against the same endpoint; trajectories,
    rewards and KV extension are what one loop gives, and the pool is kept across calls and stopped by close."""
    path = tmp_path / "pool_agent.py"
    pids = tmp_path / "pids.txt"
    path.write_text(f"PIDS = {str(pids)!r}\n" + POOL_AGENT)
    eng = _engine(model, max_num_seqs=16, workers=2, path=path)
    try:
        for _ in range(2):
            out = eng.generate(_prompts(3, n=2))
            m = out.meta_info["metrics"]
            assert m["agent/tasks"] == 6 and m["agent/errors"] == 0 and m["agent/requests"] == 18, m
            assert m["agent/extended_requests"] == 12, m
            # the workers' task clocks are the engine's (CLOCK_MONOTONIC is per host)
            assert 0 < m["agent/first_task_start_ms"] < m["agent/first_arrival_ms"] < 30e3, m
            b = out.batch
            for row in range(6):
                ends = b["turn_rewards"][row].nonzero().flatten().tolist()
                assert len(ends) == 3 and all(b["response_mask"][row, e] == 1 for e in ends)
                assert torch.allclose(b["turn_rewards"][row][ends], torch.tensor([0.1, 0.2, 1.3]))
            assert torch.allclose(hf_logprobs(model, out, 1.0), b["rollout_log_probs"], atol=2e-4)
        pool = eng.agent.pool
        assert pool is not None and pool.workers == 2
        # share j (tasks j, j + 2, ...: here the samples' second responses) ran in process j, in both calls: one
        # process never runs two shares one after the other
        by_share: dict[str, set[str]] = {}
        for line in pids.read_text().splitlines():
            session, pid = line.split()
            by_share.setdefault(session.rsplit("-", 1)[1], set()).add(pid)
        assert len(by_share["0"]) == len(by_share["1"]) == 1 and by_share["0"] != by_share["1"], by_share
    finally:
        eng.close()
    assert eng.agent.pool is None


INTERVALS: list[float] = []


async def interval_agent(client, sample):
    """Records the interpreter's switch interval while its request is served."""
    INTERVALS.append(sys.getswitchinterval())
    await _ask(client, [{"role": "user", "content": "hi"}])
    INTERVALS.append(sys.getswitchinterval())
    return AgentResult(reward=0.0)


def test_serving_knobs_are_honoured_and_restored(engine):
    """rollout.agent.switch_interval_ms holds while the endpoint serves, Python's comes back after; check_every
    sets the decode steps between the scheduler's looks."""
    INTERVALS.clear()
    before = sys.getswitchinterval()
    saved = engine.agent.cfg
    engine.agent.cfg = dataclasses.replace(saved, switch_interval_ms=0.25, check_every=3)
    engine.agent.agent = interval_agent
    seen = []
    real = agent_scheduler.AgentScheduler.__init__

    def spy(self, *a, **kw):
        seen.append(kw["check_every"])
        real(self, *a, **kw)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(agent_scheduler.AgentScheduler, "__init__", spy)
            out = engine.generate(_prompts(1))
    finally:
        engine.agent.cfg, engine.agent.agent = saved, chat_agent
    assert out.meta_info["metrics"]["agent/errors"] == 0
    assert INTERVALS == pytest.approx([0.00025, 0.00025], abs=2e-6) and seen == [3]
    assert sys.getswitchinterval() == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the asynchronous readout paths are CUDA's")
def test_readouts_and_finished_rows_while_later_steps_are_queued():
    """On a GPU a readout is the state after the work queued before it (not after later work), and finished rows
    gathered on the side stream while later work runs are the rows as they were: the later work writes only the
    trash column R and rows still decoding."""
    from hybridflow.rollout.model_runner import ModelRunner, Readout

    dev, S, R = torch.device("cuda"), 8, 64
    runner = SimpleNamespace(device=dev, _side=None, out_logp=torch.full((S, R + 1), 0.5, device=dev),
                             out_tok=torch.arange(R + 1, device=dev).repeat(S, 1))
    done = torch.zeros(S, dtype=torch.long, device=dev)
    done[[1, 5]] = 1
    readout = Readout(torch.stack([done, torch.full((S,), 10, device=dev)]))
    a = torch.randn(2048, 2048, device=dev)
    for _ in range(50):  # later work, still running when the host reads
        a = torch.tanh(a @ a)
    done[[0, 2]] = 1
    runner.out_tok[:, R] = -1
    runner.out_tok[[0, 2]] = -7
    flags, steps = readout.wait()[0].tolist()
    toks, logps = ModelRunner.finished_rows(runner, [1, 5], 10, readout)
    assert flags == [0, 1, 0, 0, 0, 1, 0, 0] and steps == [10] * S
    assert toks == [list(range(10))] * 2 and logps == [[0.5] * 10] * 2
    torch.cuda.synchronize()
