"""Continuous batching on the host: finished sequences leave their slot, waiting prompts enter it.

A prompt with n samples is admitted when n slots are free: it is prefilled once and its K/V copied into the n
slots (prefix sharing). Prefill of admitted prompts is batched up to `max_num_batched_tokens`. Decode runs
`check_every` steps between looks at the device's `done` flags (the only host sync), never more steps than
the longest live request can still need, attending only to the cache columns those steps can reach. Slots are handed out lowest first so the decode bucket stays small.
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hybridflow.rollout.model_runner import ModelRunner
from hybridflow.rollout.versions import TokenVersions
from hybridflow.utils.progress import beat

logger = logging.getLogger(__name__)


@dataclass
class GenerateResult:
    tokens: torch.Tensor  # [B*n, R] right-padded with pad id
    log_probs: torch.Tensor  # [B*n, R], 0 after the end
    lengths: torch.Tensor  # [B*n] generated tokens incl. the stop token
    decode_steps: int
    prefills: int
    # [B*n, R] policy version that sampled each token (with a `weight_check`; None without one)
    versions: torch.Tensor | None = field(default=None, kw_only=True)
    weight_swaps: int = field(default=0, kw_only=True)  # new weights taken mid-call


class Scheduler:
    def __init__(self, runner: ModelRunner, *, max_num_batched_tokens: int, check_every: int) -> None:
        if check_every < 1:
            raise ValueError(f"check_every={check_every} must be >= 1")
        self.runner, self.max_tokens, self.check_every = runner, max_num_batched_tokens, check_every

    def run(self, ids_BP: torch.Tensor, mask_BP: torch.Tensor, pos_BP: torch.Tensor, n: int, seeds: list[int],
            max_new: int, weight_check: Callable[[], int] | None = None) -> GenerateResult:
        """Generate n samples for each of B prompts; row i*n+j of the result is sample j of prompt i.
        `weight_check` (partial rollouts): called before each decode chunk, it may install new weights and returns
        the policy version in effect; the result's `versions` says which version sampled each token."""
        r = self.runner
        B, P = ids_BP.shape
        if n > r.cache.slots:
            raise ValueError(f"rollout.n={n} exceeds the {r.cache.slots} KV slots; raise rollout.max_num_seqs "
                             "or the KV budget (rollout.kv_cache_tokens / gpu_memory_utilization)")
        tokens = torch.full((B * n, r.R), r.pad_id, dtype=torch.long, device=r.device)
        logps = torch.zeros(B * n, r.R, dtype=torch.float32, device=r.device)
        lengths = torch.zeros(B * n, dtype=torch.long, device=r.device)
        waiting = deque(range(B))
        free = list(range(r.cache.slots))
        heapq.heapify(free)
        live: dict[int, int] = {}  # slot -> output row
        host_steps: dict[int, int] = {}  # slot -> tokens generated (upper bound known to the host)
        prompts_per_prefill = max(1, self.max_tokens // max(P, 1))
        decode_steps = prefills = 0
        versions = TokenVersions(weight_check, B * n, r.R) if weight_check is not None else None
        while waiting or live:
            beat()  # one per decode chunk, for the hang watchdog
            if versions is not None and decode_steps:
                versions.poll(r, live)
            while waiting and len(free) >= n:
                slots, rows = admit_next(r, waiting, free, n, prompts_per_prefill, ids_BP, mask_BP, pos_BP, seeds,
                                         max_new)
                prefills += 1
                if versions is not None:
                    versions.admit(slots)
                live.update(zip(slots, rows))
                host_steps.update((s, 1) for s in slots)
            remaining = max(max_new - host_steps[s] for s in live)
            todo = min(self.check_every, remaining)
            if todo > 0:
                # a live slot writes column P + host_steps - 1 at its next step; the chunk must stay below L
                kv_needed = P + max(host_steps.values()) + todo - 1
                b, L = r.shape(max(live), remaining, kv_needed)
                for _ in range(todo):
                    r.step_(b, L)
                decode_steps += todo
                for s in live:
                    host_steps[s] += todo
            done = r.done_mask().numpy()
            finished = [s for s in live if done[s]]
            if not finished and todo == 0:
                raise RuntimeError(f"scheduler made no progress: live slots {sorted(live)} not done at max length")
            if finished:
                tok, logp, lens = r.harvest(finished)
                rows_t = torch.tensor([live.pop(s) for s in finished], device=r.device)
                tokens[rows_t], logps[rows_t], lengths[rows_t] = tok, logp, lens
                for s, row in zip(finished, rows_t.tolist()):
                    heapq.heappush(free, s)
                    del host_steps[s]
                    if versions is not None:
                        versions.finish(s, row)
        return GenerateResult(tokens, logps, lengths, decode_steps, prefills,
                              versions=None if versions is None else versions.out.to(r.device),
                              weight_swaps=0 if versions is None else versions.swaps)


def admit_next(r: ModelRunner, waiting: deque[int], free: list[int], n: int, prompts_per_prefill: int,
               ids_BP: torch.Tensor, mask_BP: torch.Tensor, pos_BP: torch.Tensor, seeds: list[int],
               max_new: int) -> tuple[list[int], list[int]]:
    """Prefill the next waiting prompts (n samples each) into free KV slots, in one forward; returns the slots
    taken and the output row of each (prompt p's j-th sample is row p * n + j). Shared by the single- and
    multi-turn schedulers."""
    k = min(len(waiting), len(free) // n, prompts_per_prefill)
    prompts = [waiting.popleft() for _ in range(k)]
    slots = [heapq.heappop(free) for _ in range(k * n)]
    rows = [p * n + j for p in prompts for j in range(n)]
    idx = torch.tensor(prompts, device=ids_BP.device)
    r.admit(slots, ids_BP[idx], mask_BP[idx], pos_BP[idx], n, [seeds[x] for x in rows], max_new)
    return slots, rows
