"""`AgentRollout`: one generate call in `rollout.agent.mode=server` — the agent tasks run against the endpoint while
the engine serves them (`AgentScheduler`), then each task's session becomes one row of the rollout batch.

A row is its session's final branch, token for token: the prompt (its first `data.max_prompt_length` ids, left
padded; a longer one continues as context at the start of the response), then the sampled and appended ids, with
`response_mask` on the sampled ones only and their sampling log-probs. A task that failed (raised or timed out)
keeps its tokens as context but trains on none of them — unless it failed because its session outgrew the context
(then it trains, as a response cut at max length does); if every task failed, the step stops with the first error.
Agent rewards go to `turn_rewards` (per turn on each completion's last sampled id, the final one on the last).
"""

from __future__ import annotations

import atexit
import logging
import sys
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hybridflow.agentic.agent_pool import AgentPool, auto_workers
from hybridflow.agentic.agent_session import Branch, Session
from hybridflow.agentic.agents import HttpClients, Outcome, load_agent, run_agents
from hybridflow.agentic.openai_api import OpenAIServer
from hybridflow.protocol import DataProto, keys
from hybridflow.rollout.agent_scheduler import AgentScheduler
from hybridflow.rollout.model_runner import ModelRunner
from hybridflow.rollout.sampling import SamplingParams, row_seed
from hybridflow.utils.tokenizer_protocol import Tokenizer

if TYPE_CHECKING:
    from hybridflow.config.schema import AgentConfig

logger = logging.getLogger(__name__)


class AgentRollout:
    def __init__(self, agent_cfg: AgentConfig, tokenizer: Tokenizer | None, chat_template: str | None, *,
                 pad_id: int, P: int, R: int) -> None:
        if tokenizer is None:
            raise ValueError("rollout.agent.mode=server needs the tokenizer (to render chats and decode samples): "
                             "pass tokenizer= to RolloutEngine/build_rollout")
        self.cfg, self.tok, self.template = agent_cfg, tokenizer, chat_template
        self.pad_id, self.P, self.R = pad_id, P, R
        self.agent = load_agent(agent_cfg.path, agent_cfg.name)  # loaded here too: a bad path fails at once
        self.workers = auto_workers(agent_cfg.workers)
        self.pool: AgentPool | None = None  # worker processes (workers > 1), started at the first generate
        self.server: OpenAIServer | None = None
        self.clients: HttpClients | None = None  # the agents' HTTP clients on the endpoint's loop (workers = 1)
        self.calls = 0
        self.last_sessions: dict[str, Session] = {}

    def start(self) -> OpenAIServer:
        """The endpoint, started on first use and kept for the run (`close` stops it)."""
        if self.server is not None and not self.server.alive:
            logger.warning("the OpenAI endpoint's process has exited; starting a new one")
            self.close()
        if self.server is None:
            self.server = OpenAIServer(self.cfg.host, self.cfg.port)
            atexit.register(self.close)
        return self.server

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.server is not None:
            try:
                if self.clients is not None:
                    self.server.run(self.clients.aclose()).result(timeout=30)
            finally:
                self.clients = None
                self.server.close()
                self.server = None

    def generate(self, runner: ModelRunner, prompts: DataProto, params: SamplingParams, *, eos_ids: list[int],
                 check_every: int) -> tuple[DataProto, dict[str, float]]:
        server = self.start()
        n, B = params.n, len(prompts)
        self.calls += 1
        samples = [{k: v[i] for k, v in prompts.non_tensor_batch.items()} for i in range(B) for _ in range(n)]
        sessions = [f"r{self.calls}-{i}-{j}" for i in range(B) for j in range(n)]
        sched = AgentScheduler(runner, self.tok, self.template, params, eos_ids=eos_ids, prompt_width=self.P,
                               check_every=self.cfg.check_every or check_every, seed=row_seed(params.seed, self.calls),
                               sessions=min(len(sessions), self.cfg.max_concurrency), overlap=self.cfg.overlap)
        python_interval = sys.getswitchinterval()
        if self.cfg.switch_interval_ms is not None:  # before the agents start: every request is served under it
            sys.setswitchinterval(self.cfg.switch_interval_ms / 1e3)
        server.set_serving(True)  # before the agents start: an early first request must not meet a 503
        try:
            limits = dict(max_concurrency=self.cfg.max_concurrency, timeout_s=self.cfg.timeout_s)
            if self.workers > 1:
                if self.pool is None:
                    self.pool = AgentPool(self.cfg.path, self.cfg.name, self.workers)
                tasks = server.run(self.pool.run(samples, [server.session_url(s) for s in sessions], sessions,
                                                 **limits))
            else:
                if self.clients is None:
                    self.clients = HttpClients()
                tasks = server.run(run_agents(self.agent, samples, server.session_url, sessions, **limits,
                                              clients=self.clients))
            try:
                sched.serve(server.calls, tasks.done)
            except BaseException:
                tasks.cancel()  # the engine failed: stop the agents rather than let them wait for answers
                raise
        finally:
            sys.setswitchinterval(python_interval)
            try:  # requests from now on get 503 at the endpoint, those read meanwhile here
                server.set_serving(False)
            except (RuntimeError, OSError, TimeoutError) as err:  # the endpoint is gone: the next call restarts it
                logger.warning("could not stop the OpenAI endpoint serving: %s", err)
        outcomes: list[Outcome] = tasks.result()
        self.last_sessions = sched.sessions  # for inspection (tests, debugging)
        failed = [o for o in outcomes if o.kind != "ok"]
        if len(failed) == len(outcomes):
            raise RuntimeError(f"every agent task failed ({len(outcomes)}); the first: session {failed[0].session}: "
                               f"{failed[0].error}")
        for o in failed[:3]:
            logger.warning("agent task %s ended: %s", o.session, o.error)
        ids, mask = prompts.batch[keys.INPUT_IDS].cpu(), prompts.batch[keys.ATTENTION_MASK].cpu().bool()
        default_prompts = [ids[i][mask[i]].tolist() for i in range(B) for _ in range(n)]
        rows = [self._row(sched.sessions.get(o.session, Session()), o, default_prompts[k])
                for k, o in enumerate(outcomes)]
        out = self._batch(rows)
        out.non_tensor_batch = {k: np.repeat(v, n, axis=0) for k, v in prompts.non_tensor_batch.items()}
        started = [o.started - sched.t_start for o in outcomes if o.started]
        timeline = {"agent/first_task_start_ms": 1e3 * min(started, default=0.0),
                    "agent/last_task_start_ms": 1e3 * max(started, default=0.0)}
        return out, self._metrics(outcomes, sched, rows) | timeline | server.take_latency()

    def _row(self, session: Session, o: Outcome, default_prompt: list[int]) -> dict[str, Any]:
        branch = session.final(o.result.messages) or Branch(default_prompt)
        full = branch.prompt + branch.resp
        cut = min(len(branch.prompt), self.P)
        resp = full[cut:][: self.R]
        # out of context budget: the agent got HTTP 400, but its ids are real samples, trained like a response cut
        # at max length in the single-turn rollout (the reward function scores what is there)
        ok = o.kind == "ok" or (o.kind == "error" and session.overflowed)
        mask = ([0] * (len(branch.prompt) - cut) + branch.mask)[: self.R] if ok else [0] * len(resp)
        logp = ([0.0] * (len(branch.prompt) - cut) + branch.logp)[: self.R]
        rewards = [0.0] * len(resp)
        ends = [e + len(branch.prompt) - cut for e in branch.turn_ends]
        ends = [e for e in ends if e < len(resp)]
        if ok and ends:
            for e, r in zip(ends, o.result.turn_rewards):
                rewards[e] += float(r)
            if o.result.reward is not None:
                rewards[ends[-1]] += float(o.result.reward)
        if not resp:  # nothing sampled (the task failed first): one context token keeps the row well-formed
            resp, mask, logp, rewards = [self.pad_id], [0], [0.0], [0.0]
        return {"prompt": full[:cut], "resp": resp, "mask": mask, "logp": logp, "rewards": rewards,
                "truncated": len(full) - cut - len(resp), "session": session, "ok": ok}

    def _batch(self, rows: list[dict[str, Any]]) -> DataProto:
        N, P, R = len(rows), self.P, self.R
        prompts = torch.full((N, P), self.pad_id, dtype=torch.long)
        p_mask = torch.zeros(N, P, dtype=torch.long)
        resp = torch.full((N, R), self.pad_id, dtype=torch.long)
        r_att, r_mask = torch.zeros(N, R, dtype=torch.long), torch.zeros(N, R, dtype=torch.long)
        logp, rewards = torch.zeros(N, R), torch.zeros(N, R)
        for i, row in enumerate(rows):
            k, m = len(row["prompt"]), len(row["resp"])
            if k:
                prompts[i, P - k:] = torch.tensor(row["prompt"])
                p_mask[i, P - k:] = 1
            resp[i, :m] = torch.tensor(row["resp"])
            r_att[i, :m] = 1
            r_mask[i, :m] = torch.tensor(row["mask"][:m])
            logp[i, :m] = torch.tensor(row["logp"][:m]) * r_mask[i, :m]
            rewards[i, :m] = torch.tensor(row["rewards"])
        attention = torch.cat([p_mask, r_att], dim=1)
        return DataProto.from_single_dict({
            keys.PROMPTS: prompts, keys.RESPONSES: resp, keys.RESPONSE_MASK: r_mask, keys.ROLLOUT_LOG_PROBS: logp,
            keys.INPUT_IDS: torch.cat([prompts, resp], dim=1), keys.ATTENTION_MASK: attention,
            keys.POSITION_IDS: (attention.cumsum(-1) - 1).clamp(min=0), keys.TURN_REWARDS: rewards})

    @staticmethod
    def _metrics(outcomes: list[Outcome], sched: AgentScheduler, rows: list[dict[str, Any]]) -> dict[str, float]:
        sessions = [row["session"] for row in rows]
        out = sched.metrics() | {
            "agent/tasks": float(len(outcomes)),
            "agent/errors": float(sum(o.kind == "error" for o in outcomes)),
            "agent/context_overflows": float(sum(s.overflowed for s in sessions)),
            "agent/timeouts": float(sum(o.kind == "timeout" for o in outcomes)),
            "agent/malformed_tool_calls": float(sum(s.malformed_tool_calls for s in sessions)),
            "agent/ended_on_malformed_call": float(sum(s.last_malformed for s in sessions)),
            "agent/rewritten_sessions": float(sum(s.rewritten for s in sessions)),
            "agent/dropped_tokens": float(sum(s.dropped_tokens for s in sessions)),
            "agent/truncated_tokens": float(sum(row["truncated"] for row in rows)),
            "agent/requests_per_task": float(np.mean([s.requests for s in sessions])),
        }
        keys = sorted({k for o in outcomes for k in o.result.metrics})
        for key in keys:
            values = [float(o.result.metrics[key]) for o in outcomes if key in o.result.metrics]
            out[f"agent/{key}"] = float(np.mean(values))
        return out
