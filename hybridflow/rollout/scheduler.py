"""Continuous batching on the host: finished sequences leave their slot, waiting prompts enter it.

A prompt with n samples is admitted when n slots are free: it is prefilled once and its K/V copied into the n
slots (prefix sharing). Prefill of admitted prompts is batched up to `max_num_batched_tokens`. Decode runs
`check_every` steps between looks at the device's `done` flags (the only host sync), never more steps than
the longest live request can still need, attending only to the cache columns those steps can reach. Slots are handed out lowest first so the decode bucket stays small.
Decision: one loop (`Scheduler._decode`) with hook methods; multi-turn (`multi_turn.py`) overrides the hooks to
pause a finished turn's slot while its tools run, rather than keeping a second copy of the loop.
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hybridflow.rollout import moe
from hybridflow.rollout.model_runner import ModelRunner
from hybridflow.rollout.versions import TokenVersions
from hybridflow.rollout.vision import PromptImages
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
    routes: torch.Tensor | None = field(default=None, kw_only=True)  # MoE: [B*n, P+R, moe layers, k] (decode's)


class RunState:
    """One `run` call's state, shared by the decode loop and a scheduler's hooks: the output rows, the prompts not
    admitted yet, and the KV slots (free, or decoding a row)."""

    def __init__(self, r: ModelRunner, B: int, n: int, weight_check: Callable[[], int] | None) -> None:
        if n > r.cache.slots:
            raise ValueError(f"rollout.n={n} exceeds the {r.cache.slots} KV slots; raise rollout.max_num_seqs "
                             "or the KV budget (rollout.kv_cache_tokens / gpu_memory_utilization)")
        self.tokens = torch.full((B * n, r.R), r.pad_id, dtype=torch.long, device=r.device)
        self.logps = torch.zeros(B * n, r.R, dtype=torch.float32, device=r.device)
        self.lengths = torch.zeros(B * n, dtype=torch.long, device=r.device)
        self.waiting = deque(range(B))
        self.free = list(range(r.cache.slots))
        heapq.heapify(self.free)
        self.live: dict[int, int] = {}  # decoding slot -> output row
        self.host_steps: dict[int, int] = {}  # live slot -> tokens generated (upper bound known to the host)
        self.decode_steps = self.prefills = 0
        self.versions = TokenVersions(weight_check, B * n, r.R) if weight_check is not None else None
        self.routes: torch.Tensor | None = None  # MoE: each row's experts per column (set by `Scheduler.run`)
        self.images: PromptImages | None = None  # vision-language prompts (set by `Scheduler.run`)

    def busy(self) -> bool:
        return bool(self.waiting or self.live)

    def started(self) -> bool:
        """Whether a forward has run since the first admission (new weights are polled from then on)."""
        return self.decode_steps > 0

    def in_flight(self) -> list[int]:
        """The slots whose sequences are unfinished (they switch to new weights at their next token)."""
        return list(self.live)

    def version_fields(self) -> dict[str, torch.Tensor | int | None]:
        """`versions` and `weight_swaps` of the result."""
        v = self.versions
        return {"versions": None if v is None else v.out.to(self.tokens.device),
                "weight_swaps": 0 if v is None else v.swaps}


class Scheduler:
    """The continuous-batching loop (`_decode`); `MultiTurnScheduler` reuses it through the hooks below it."""

    def __init__(self, runner: ModelRunner, *, max_num_batched_tokens: int, check_every: int) -> None:
        if check_every < 1:
            raise ValueError(f"check_every={check_every} must be >= 1")
        self.runner, self.max_tokens, self.check_every = runner, max_num_batched_tokens, check_every

    def run(self, ids_BP: torch.Tensor, mask_BP: torch.Tensor, pos_BP: torch.Tensor, n: int, seeds: list[int],
            max_new: int, weight_check: Callable[[], int] | None = None,
            images: PromptImages | None = None) -> GenerateResult:
        """Generate n samples for each of B prompts; row i*n+j of the result is sample j of prompt i.
        `weight_check` (partial rollouts): called before each decode chunk, it may install new weights and returns
        the policy version in effect; the result's `versions` says which version sampled each token. `images`
        (vision-language prompts): their embeddings and 3-D positions, which replace `pos_BP` in prefill."""
        st = RunState(self.runner, ids_BP.shape[0], n, weight_check)
        st.images = images
        if images is not None:
            pos_BP = images.pos_BP3
        r = self.runner
        st.routes = None if r.routes is None else moe.route_buffer(r.weights.layers, st.tokens.shape[0],
                                                                   ids_BP.shape[1] + r.R, r.device)
        self._decode(st, ids_BP, mask_BP, pos_BP, n, seeds, max_new)
        return GenerateResult(st.tokens, st.logps, st.lengths, st.decode_steps, st.prefills, **st.version_fields(),
                              routes=st.routes)

    def _decode(self, st: RunState, ids_BP: torch.Tensor, mask_BP: torch.Tensor, pos_BP: torch.Tensor, n: int,
                seeds: list[int], max_new: int) -> None:
        """The loop: admit waiting prompts into free slots, let the hooks resume slots, decode up to
        `check_every` steps, then hand the slots whose `done` flag rose to `_retire`."""
        r = self.runner
        P = ids_BP.shape[1]
        prompts_per_prefill = max(1, self.max_tokens // max(P, 1))
        while st.busy():
            beat()  # one per decode chunk, for the hang watchdog
            if st.versions is not None and st.started():
                st.versions.poll(r, st.in_flight())
            while st.waiting and len(st.free) >= n:
                slots, rows = admit_next(r, st.waiting, st.free, n, prompts_per_prefill, ids_BP, mask_BP, pos_BP,
                                         seeds, max_new, st.images)
                st.prefills += 1
                if st.versions is not None:
                    st.versions.admit(slots)
                st.live.update(zip(slots, rows))
                st.host_steps.update((s, 1) for s in slots)
                self._admitted(st, slots)
            self._resume(st, P, n, max_new)
            if not st.live:
                self._idle(st)
                continue
            remaining = max(max_new - st.host_steps[s] for s in st.live)
            todo = min(self.check_every, remaining)
            if todo > 0:
                # a live slot writes column P + host_steps - 1 at its next step; the chunk must stay below L
                kv_needed = P + max(st.host_steps.values()) + todo - 1
                bucket, L = r.shape(max(st.live), remaining, kv_needed)
                for _ in range(todo):
                    r.step_(bucket, L)
                st.decode_steps += todo
                for s in st.live:
                    st.host_steps[s] += todo
            if not self._retire(st, max_new) and todo == 0:
                raise RuntimeError(f"scheduler made no progress: live slots {sorted(st.live)} not done at max "
                                   "length")

    # ---- hooks: a scheduler that pauses slots between turns (multi_turn.py) overrides these
    def _admitted(self, st: RunState, slots: list[int]) -> None:
        """Slots just prefilled with a new prompt."""

    def _resume(self, st: RunState, P: int, n: int, max_new: int) -> None:
        """Before each decode chunk: put slots that were set aside back into `st.live`."""

    def _idle(self, st: RunState) -> None:
        """No slot is decoding but `st.busy()`: wait for whatever the slots set aside wait on."""
        raise AssertionError(f"no live slot, yet {len(st.waiting)} prompts wait and {len(st.free)} slots are free")

    def _retire(self, st: RunState, max_new: int) -> list[int]:
        """After a decode chunk: the live slots whose `done` flag rose leave `st.live`; returns them."""
        r = self.runner
        done = r.done_mask().numpy()
        finished = [s for s in st.live if done[s]]
        if finished:
            tok, logp, lens = r.harvest(finished)
            rows_t = torch.tensor([st.live.pop(s) for s in finished], device=r.device)
            st.tokens[rows_t], st.logps[rows_t], st.lengths[rows_t] = tok, logp, lens
            if st.routes is not None:
                st.routes[rows_t] = r.routes[torch.tensor(finished, device=r.device), :st.routes.shape[1]]
            for s, row in zip(finished, rows_t.tolist()):
                heapq.heappush(st.free, s)
                del st.host_steps[s]
                if st.versions is not None:
                    st.versions.finish(s, row)
        return finished


def admit_next(r: ModelRunner, waiting: deque[int], free: list[int], n: int, prompts_per_prefill: int,
               ids_BP: torch.Tensor, mask_BP: torch.Tensor, pos_BP: torch.Tensor, seeds: list[int],
               max_new: int, images: PromptImages | None = None) -> tuple[list[int], list[int]]:
    """Prefill the next waiting prompts (n samples each) into free KV slots, in one forward; returns the slots
    taken and the output row of each (prompt p's j-th sample is row p * n + j)."""
    k = min(len(waiting), len(free) // n, prompts_per_prefill)
    prompts = [waiting.popleft() for _ in range(k)]
    slots = [heapq.heappop(free) for _ in range(k * n)]
    rows = [p * n + j for p in prompts for j in range(n)]
    idx = torch.tensor(prompts, device=ids_BP.device)
    r.admit(slots, ids_BP[idx], mask_BP[idx], pos_BP[idx], n, [seeds[x] for x in rows], max_new,
            None if images is None else images.take(prompts))
    return slots, rows
