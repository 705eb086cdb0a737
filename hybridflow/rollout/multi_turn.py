"""Multi-turn scheduling: continuous batching where a finished turn may hand its slot to tools and come back.

`Scheduler`'s admission and decode loop, run through its hooks; what differs is what happens when a slot's
`done` flag rises.
The host decodes that turn's tokens and asks the `session` (`agentic/session.ToolSession`) for tool calls; if there
are any, the slot *pauses* (keeps its KV cache, leaves the decode set) while the calls run in the session's thread
pool, and the other slots keep decoding. When the results are ready their token ids are appended with
`ModelRunner.extend_many` — only the new tokens are prefilled, earlier turns stay in the cache, and every slot
ready at that moment is extended in one batched forward — and the slot decodes
its next turn. Token in, token out: the response row is the exact sequence of sampled and appended ids, and
`model_mask` marks which were sampled (the only ones trained on). The whole trajectory shares the response budget
R = data.max_response_length; a tool response that leaves no room for one more model token ends the trajectory.
A turn's reward from its tools or the interaction (`TurnResult.reward`) lands in `turn_rewards` on the turn's last
model token. A turn that goes to an interaction pauses the same way (the step runs in the session's pool), and its
observation — a user message through the chat template — is appended like a tool response.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybridflow.rollout.model_runner import ModelRunner
from hybridflow.rollout.scheduler import GenerateResult, RunState, Scheduler

if TYPE_CHECKING:
    from hybridflow.agentic.session import Pending, ToolSession

logger = logging.getLogger(__name__)

POLL_S = 0.05  # longest wait for a tool when nothing else can run


@dataclass
class MultiTurnResult(GenerateResult):
    model_mask: torch.Tensor  # [B*n, R] 1 on sampled tokens, 0 on appended tool/user tokens and padding
    turn_rewards: torch.Tensor  # [B*n, R] float: each turn's tool/interaction reward on its last model token
    extend_tokens: int  # tokens prefilled by extensions (appended ids + one re-fed token per extension)
    tool_wait_s: float  # host time spent with no slot to decode, waiting for tools


class TurnState(RunState):
    """`RunState` plus what multi-turn adds: the model mask, turn rewards, and the slots paused on tools."""

    def __init__(self, r: ModelRunner, B: int, n: int, weight_check: Callable[[], int] | None,
                 pos_BP: torch.Tensor) -> None:
        super().__init__(r, B, n, weight_check)
        self.model_mask = torch.zeros(B * n, r.R, dtype=torch.long, device=r.device)
        self.turn_rewards = torch.zeros(B * n, r.R, dtype=torch.float32, device=r.device)
        self.resp_pos0 = (pos_BP[:, -1] + 1).tolist()
        self.paused: dict[int, tuple[int, Pending, int]] = {}  # slot waiting on tools -> (row, calls, step)
        self.turn_start: dict[int, int] = {}  # slot -> response index where its current turn began
        self.appended: dict[int, list[tuple[int, int]]] = {}  # slot -> [start, end) spans of appended ids
        self.extend_tokens = 0
        self.tool_wait = 0.0

    def busy(self) -> bool:
        return super().busy() or bool(self.paused)

    def started(self) -> bool:
        return super().started() or self.extend_tokens > 0

    def in_flight(self) -> list[int]:
        return [*self.live, *self.paused]


class MultiTurnScheduler(Scheduler):
    """`Scheduler`'s loop; a finished turn hands its slot to the session's tools instead of ending."""

    def __init__(self, runner: ModelRunner, session: ToolSession, *, max_num_batched_tokens: int,
                 check_every: int) -> None:
        super().__init__(runner, max_num_batched_tokens=max_num_batched_tokens, check_every=check_every)
        self.session = session

    def run(self, ids_BP: torch.Tensor, mask_BP: torch.Tensor, pos_BP: torch.Tensor, n: int, seeds: list[int],
            max_new: int, weight_check: Callable[[], int] | None = None) -> MultiTurnResult:
        """As `Scheduler.run`; a paused slot (waiting on tools) that sees new weights samples its next turn with
        them."""
        st = TurnState(self.runner, ids_BP.shape[0], n, weight_check, pos_BP)
        self._decode(st, ids_BP, mask_BP, pos_BP, n, seeds, max_new)
        return MultiTurnResult(st.tokens, st.logps, st.lengths, st.decode_steps, st.prefills, st.model_mask,
                               st.turn_rewards, st.extend_tokens, st.tool_wait, **st.version_fields())

    def _admitted(self, st: TurnState, slots: list[int]) -> None:
        for s in slots:
            st.turn_start[s], st.appended[s] = 0, []

    def _resume(self, st: TurnState, P: int, n: int, max_new: int) -> None:
        """Slots whose tools are done: append the results and extend them all in one batched forward."""
        ready = [s for s, (_, pending, _) in st.paused.items() if pending.ready()]
        resume: list[tuple[int, list[int], int]] = []
        resume_steps: list[int] = []
        for s in ready:
            row, pending, step = st.paused.pop(s)
            result = self.session.collect(row, pending)
            st.turn_rewards[row, step - 1] += result.reward  # the turn's last model token
            new_ids = result.ids
            if new_ids is None or step + len(new_ids) >= max_new:  # ended, or no room for a model token
                self._finish(st, s, row)
                continue
            resume.append((s, new_ids, st.resp_pos0[row // n]))
            resume_steps.append(step)
            st.extend_tokens += len(new_ids) + 1
            st.appended[s].append((step, step + len(new_ids)))
            st.turn_start[s] = step + len(new_ids)
            st.live[s] = row
        if resume:
            lengths_now = self.runner.extend_many(resume, P, steps=resume_steps, max_new=[max_new] * len(resume))
            for (s, _, _), length in zip(resume, lengths_now):
                st.host_steps[s] = length

    def _idle(self, st: TurnState) -> None:
        if st.paused and not any(p.ready() for _, p, _ in st.paused.values()):
            t0 = time.perf_counter()
            futures = [f for _, p, _ in st.paused.values() for f in p.futures()]
            wait(futures, timeout=POLL_S, return_when=FIRST_COMPLETED)
            st.tool_wait += time.perf_counter() - t0

    def _retire(self, st: TurnState, max_new: int) -> list[int]:
        """A finished turn asks the session for tool calls: with some the slot pauses, else the row is done."""
        r = self.runner
        done, steps_now = r.done_and_steps()  # one sync
        finished = [s for s in st.live if done[s]]
        # the finished slots' outputs in one copy; the GPU keeps nothing queued behind it to wait for
        out_rows = r.out_tok[torch.tensor(finished, device=r.device)].cpu() if finished else None
        for i, s in enumerate(finished):
            row = st.live.pop(s)
            del st.host_steps[s]
            step = int(steps_now[s])
            turn_ids = out_rows[i, st.turn_start[s]: step].tolist()
            pending = self.session.on_turn_end(row, turn_ids, turn_complete=step < max_new)
            if pending is None:
                self._finish(st, s, row)
            else:
                st.paused[s] = (row, pending, step)
        return finished

    def _finish(self, st: TurnState, s: int, row: int) -> None:
        r = self.runner
        tok, logp, lens = r.harvest([s])
        length = int(lens[0])
        mask = (torch.arange(r.R, device=r.device) < length).long()
        for start, end in st.appended.pop(s):
            mask[start:end] = 0
        st.tokens[row], st.logps[row], st.lengths[row], st.model_mask[row] = tok[0], logp[0] * mask, length, mask
        self.session.end(row)
        if st.versions is not None:
            st.versions.finish(s, row)
        heapq.heappush(st.free, s)
