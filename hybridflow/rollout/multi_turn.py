"""Multi-turn scheduling: continuous batching where a finished turn may hand its slot to tools and come back.

Same admission and decode loop as `Scheduler`; the difference is what happens when a slot's `done` flag rises.
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
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass

import torch

from hybridflow.rollout.model_runner import ModelRunner
from hybridflow.rollout.scheduler import GenerateResult, admit_next
from hybridflow.rollout.versions import TokenVersions

logger = logging.getLogger(__name__)

POLL_S = 0.05  # longest wait for a tool when nothing else can run


@dataclass
class MultiTurnResult(GenerateResult):
    model_mask: torch.Tensor  # [B*n, R] 1 on sampled tokens, 0 on appended tool/user tokens and padding
    turn_rewards: torch.Tensor  # [B*n, R] float: each turn's tool/interaction reward on its last model token
    extend_tokens: int  # tokens prefilled by extensions (appended ids + one re-fed token per extension)
    tool_wait_s: float  # host time spent with no slot to decode, waiting for tools


class MultiTurnScheduler:
    def __init__(self, runner: ModelRunner, session, *, max_num_batched_tokens: int, check_every: int) -> None:
        self.runner, self.session, self.max_tokens, self.check_every = runner, session, max_num_batched_tokens, check_every
        self._versions: TokenVersions | None = None

    def run(self, ids_BP: torch.Tensor, mask_BP: torch.Tensor, pos_BP: torch.Tensor, n: int, seeds: list[int],
            max_new: int, weight_check: Callable[[], int] | None = None) -> MultiTurnResult:
        """As `Scheduler.run`; a paused slot (waiting on tools) that sees new weights samples its next turn with
        them."""
        r, session = self.runner, self.session
        B, P = ids_BP.shape
        if n > r.cache.slots:
            raise ValueError(f"rollout.n={n} exceeds the {r.cache.slots} KV slots; raise rollout.max_num_seqs")
        tokens = torch.full((B * n, r.R), r.pad_id, dtype=torch.long, device=r.device)
        logps = torch.zeros(B * n, r.R, dtype=torch.float32, device=r.device)
        lengths = torch.zeros(B * n, dtype=torch.long, device=r.device)
        model_mask = torch.zeros(B * n, r.R, dtype=torch.long, device=r.device)
        turn_rewards = torch.zeros(B * n, r.R, dtype=torch.float32, device=r.device)
        resp_pos0 = (pos_BP[:, -1] + 1).tolist()
        waiting, free = deque(range(B)), list(range(r.cache.slots))
        heapq.heapify(free)
        live: dict[int, int] = {}  # decoding slot -> output row
        paused: dict[int, tuple[int, object, int]] = {}  # slot waiting on tools -> (row, PendingTools, step)
        host_steps: dict[int, int] = {}  # live slot -> tokens in its response (upper bound)
        turn_start: dict[int, int] = {}  # slot -> response index where its current turn began
        appended: dict[int, list[tuple[int, int]]] = {}  # slot -> [start, end) spans of appended ids
        prompts_per_prefill = max(1, self.max_tokens // max(P, 1))
        decode_steps = prefills = extend_tokens = 0
        tool_wait = 0.0
        self._versions = TokenVersions(weight_check, B * n, r.R) if weight_check is not None else None
        while waiting or live or paused:
            if self._versions is not None and (decode_steps or extend_tokens):
                self._versions.poll(r, [*live, *paused])
            while waiting and len(free) >= n:
                slots, rows = admit_next(r, waiting, free, n, prompts_per_prefill, ids_BP, mask_BP, pos_BP, seeds,
                                         max_new)
                prefills += 1
                if self._versions is not None:
                    self._versions.admit(slots)
                live.update(zip(slots, rows))
                for s in slots:
                    host_steps[s], turn_start[s], appended[s] = 1, 0, []
            ready = [s for s, (_, pending, _) in paused.items() if pending.ready()]
            resume: list[tuple[int, list[int], int]] = []  # extended together: one batched forward
            resume_steps: list[int] = []
            for s in ready:
                row, pending, step = paused.pop(s)
                result = session.collect(row, pending)
                turn_rewards[row, step - 1] += result.reward  # the turn's last model token
                new_ids = result.ids
                if new_ids is None or step + len(new_ids) >= max_new:  # ended, or no room for a model token
                    self._finish(s, row, tokens, logps, lengths, model_mask, appended, free)
                    continue
                resume.append((s, new_ids, resp_pos0[row // n]))
                resume_steps.append(step)
                extend_tokens += len(new_ids) + 1
                appended[s].append((step, step + len(new_ids)))
                turn_start[s] = step + len(new_ids)
                live[s] = row
            if resume:
                lengths_now = r.extend_many(resume, P, steps=resume_steps, max_new=[max_new] * len(resume))
                for (s, _, _), length in zip(resume, lengths_now):
                    host_steps[s] = length
            if live:
                remaining = max(max_new - host_steps[s] for s in live)
                todo = min(self.check_every, remaining)
                if todo > 0:
                    kv_needed = P + max(host_steps[s] for s in live) + todo - 1
                    b, L = r.shape(max(live), remaining, kv_needed)
                    for _ in range(todo):
                        r.step_(b, L)
                    decode_steps += todo
                    for s in live:
                        host_steps[s] += todo
                done, steps_now = r.done_and_steps()  # one sync
                finished = [s for s in live if done[s]]
                # the finished slots' outputs in one copy; the GPU keeps nothing queued behind it to wait for
                out_rows = r.out_tok[torch.tensor(finished, device=r.device)].cpu() if finished else None
                for i, s in enumerate(finished):
                    row = live.pop(s)
                    del host_steps[s]
                    step = int(steps_now[s])
                    turn_ids = out_rows[i, turn_start[s]: step].tolist()
                    pending = session.on_turn_end(row, turn_ids, turn_complete=step < max_new)
                    if pending is None:
                        self._finish(s, row, tokens, logps, lengths, model_mask, appended, free)
                    else:
                        paused[s] = (row, pending, step)
            elif paused and not any(p.ready() for _, p, _ in paused.values()):
                t0 = time.perf_counter()
                futures = [f for _, p, _ in paused.values() for f in p.futures()]
                wait(futures, timeout=POLL_S, return_when=FIRST_COMPLETED)
                tool_wait += time.perf_counter() - t0
        v = self._versions
        return MultiTurnResult(tokens, logps, lengths, decode_steps, prefills, model_mask, turn_rewards,
                               extend_tokens, tool_wait, versions=None if v is None else v.out.to(r.device),
                               weight_swaps=0 if v is None else v.swaps)

    def _finish(self, s: int, row: int, tokens: torch.Tensor, logps: torch.Tensor, lengths: torch.Tensor,
                model_mask: torch.Tensor, appended: dict[int, list[tuple[int, int]]], free: list[int]) -> None:
        r = self.runner
        tok, logp, lens = r.harvest([s])
        length = int(lens[0])
        mask = (torch.arange(r.R, device=r.device) < length).long()
        for a, b in appended.pop(s):
            mask[a:b] = 0
        tokens[row], logps[row], lengths[row], model_mask[row] = tok[0], logp[0] * mask, length, mask
        self.session.end(row)
        if self._versions is not None:
            self._versions.finish(s, row)
        heapq.heappush(free, s)
