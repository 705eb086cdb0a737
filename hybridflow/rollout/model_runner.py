"""Device-side decode state per KV slot, the decode step (forward + sampler + bookkeeping) and its CUDA graphs.

Everything a step needs lives in static per-slot buffers, so one step is a fixed sequence of kernels over the
first `b` slots: it is captured once per (batch bucket, sampling mode) as a CUDA graph and replayed with no host
synchronisation; the host reads `done` only when the scheduler asks. Finished rows keep running (masked) until
then — cheaper than a sync per token. Graphs are captured while no slot is live, so warm-up runs harm nothing.

Legend: S slots, T cache columns, R max new tokens (+1 trash column for writes of finished rows), V vocab.
"""

from __future__ import annotations

import logging
import time

import torch

from hybridflow.rollout import forward
from hybridflow.rollout.forward import DecodeOps, RopeTable
from hybridflow.rollout.kv_cache import KVCache
from hybridflow.rollout.sampling import SamplingParams, sample
from hybridflow.rollout.weights import ArchSpec, ModelWeights

logger = logging.getLogger(__name__)


def buckets_for(slots: int) -> list[int]:
    """Decode batch sizes with a graph: powers of two from 8, and `slots` itself."""
    out, b = [], 8
    while b < slots:
        out.append(b)
        b *= 2
    return out + [slots]


class ModelRunner:
    """Owns the KV cache and slot state; `admit` prefills prompts into slots, `step` decodes all live slots."""

    def __init__(self, spec: ArchSpec, weights: ModelWeights, rope: RopeTable, cache: KVCache, *, pad_id: int,
                 max_new_tokens: int, use_graphs: bool, ops: DecodeOps) -> None:
        self.spec, self.weights, self.rope, self.cache, self.ops = spec, weights, rope, cache, ops
        self.pad_id, self.R, self.use_graphs = pad_id, max_new_tokens, use_graphs
        S, T = cache.slots, cache.max_len
        dev = cache.k[0].device
        self.device = dev
        zeros = dict(dtype=torch.long, device=dev)
        self.tok, self.pos, self.cidx, self.step = (torch.zeros(S, **zeros) for _ in range(4))
        self.seed, self.max_new = torch.zeros(S, **zeros), torch.full((S,), max_new_tokens, **zeros)
        self.done = torch.ones(S, dtype=torch.bool, device=dev)
        self.valid = torch.zeros(S, T, dtype=torch.bool, device=dev)
        self.out_tok = torch.full((S, max_new_tokens + 1), pad_id, **zeros)
        self.out_logp = torch.zeros(S, max_new_tokens + 1, dtype=torch.float32, device=dev)
        self.temperature = torch.ones((), dtype=torch.float32, device=dev)
        self.top_k = torch.tensor(spec.vocab, device=dev)
        self.top_p = torch.ones((), dtype=torch.float32, device=dev)
        self.is_stop = torch.zeros(spec.vocab, dtype=torch.bool, device=dev)  # vocab lookup: any number of stop ids
        self.mode = "sample"
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.buckets = buckets_for(S)
        self.capture_s = 0.0  # time of the last capture() that captured anything

    # ------------------------------------------------------------------------------------------- configuration
    def set_sampling(self, params: SamplingParams, eos_ids: list[int]) -> None:
        stops = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids)))
        bad = [t for t in stops if not 0 <= t < self.spec.vocab]
        if bad:
            raise ValueError(f"stop/eos token ids {bad} are outside the vocabulary [0, {self.spec.vocab})")
        self.is_stop.fill_(False)
        if stops:
            self.is_stop[torch.tensor(stops, device=self.device)] = True
        self.temperature.fill_(params.temperature if params.do_sample else 1.0)
        self.top_k.fill_(params.top_k if params.top_k > 0 else self.spec.vocab)
        self.top_p.fill_(params.top_p)
        self.mode = params.mode

    def set_weights(self, weights: ModelWeights) -> None:
        """New views; captured graphs are dropped only if any tensor moved (zero-copy weights never move)."""
        if weights.ptrs != self.weights.ptrs and self.graphs:
            logger.info("weight storage moved; dropping %d CUDA graphs", len(self.graphs))
            self.graphs.clear()
        self.weights = weights

    # -------------------------------------------------------------------------------------------------- prefill
    def admit(self, slots: list[int], ids_BP: torch.Tensor, mask_BP: torch.Tensor, pos_BP: torch.Tensor, n: int,
              seeds: list[int], max_new: int) -> None:
        """Prefill B prompts once, give prompt i the n slots slots[i*n:(i+1)*n], sample each slot's first token."""
        B, P = ids_BP.shape
        assert len(slots) == B * n == len(seeds), (len(slots), B, n, len(seeds))
        assert P + max_new <= self.cache.max_len, (P, max_new, self.cache.max_len)
        dev = self.device
        slot_t = torch.tensor(slots, device=dev)
        src = torch.arange(B, device=dev).repeat_interleave(n)
        logits = forward.prefill(self.weights, self.spec, self.rope, ids_BP, mask_BP, pos_BP, self.cache, slot_t, src)
        seeds_t = torch.tensor(seeds, dtype=torch.long, device=dev)
        tok, logp = sample(logits[src], self.mode, self.temperature, self.top_k, self.top_p, seeds_t,
                           torch.zeros_like(seeds_t))
        self.valid[slot_t] = False
        self.valid[slot_t, :P] = mask_BP.bool()[src]
        self.out_tok[slot_t] = self.pad_id
        self.out_logp[slot_t] = 0.0
        self.out_tok[slot_t, 0] = tok
        self.out_logp[slot_t, 0] = logp
        self.seed[slot_t] = seeds_t
        self.tok[slot_t] = tok
        self.pos[slot_t] = pos_BP[src, -1] + 1
        self.cidx[slot_t] = P
        self.step[slot_t] = 1
        self.max_new[slot_t] = max_new
        stop = self.is_stop[tok]
        self.done[slot_t] = stop | (max_new <= 1)

    # --------------------------------------------------------------------------------------------------- decode
    def _step(self, b: int, mode: str) -> None:
        T = self.cache.max_len
        logits = forward.decode(self.weights, self.spec, self.rope, self.ops, self.tok[:b], self.pos[:b],
                                self.cidx[:b], self.valid[:b], self.cache)
        step, done = self.step[:b], self.done[:b]
        tok, logp = self.ops.sample(logits, mode, self.temperature, self.top_k, self.top_p, self.seed[:b], step)
        live = ~done
        col = torch.where(live, step, self.R)[:, None]  # finished rows write into the trash column R
        self.out_tok[:b].scatter_(1, col, tok[:, None])
        self.out_logp[:b].scatter_(1, col, logp[:, None])
        new_step = step + live.long()
        stop = self.is_stop[tok]
        done |= live & (stop | (new_step >= self.max_new[:b]))
        step.copy_(new_step)
        self.tok[:b].copy_(tok)
        self.pos[:b].add_(1).clamp_(max=self.rope.max_len - 1)
        self.cidx[:b].add_(1).clamp_(max=T - 1)

    def bucket(self, highest_live_slot: int) -> int:
        need = highest_live_slot + 1
        return next(b for b in self.buckets if b >= need)

    def step_(self, b: int) -> None:
        """One decode step over slots [0, b) — b must be a bucket when graphs are on."""
        if not self.use_graphs:
            self._step(b, self.mode)
            return
        graph = self.graphs.get((b, self.mode))
        if graph is None:
            raise RuntimeError(f"no CUDA graph for bucket {b} mode {self.mode}; call capture() while no slot is live")
        graph.replay()

    def capture(self) -> None:
        """Capture graphs for every bucket of the current mode (only while all slots are finished: warm-up steps
        write into dead slots, whose state is reset at admission)."""
        if not self.use_graphs or all((b, self.mode) in self.graphs for b in self.buckets):
            return
        assert bool(self.done.all()), "capture() needs every slot finished"
        t0 = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        for b in sorted(self.buckets, reverse=True):  # largest first: smaller graphs reuse its pool memory
            if (b, self.mode) in self.graphs:
                continue
            self._warm_up(b)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._step(b, self.mode)
            self.graphs[(b, self.mode)] = graph
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - t0
        logger.info("captured CUDA graphs for mode %s, buckets %s in %.2fs", self.mode, self.buckets, self.capture_s)

    def _warm_up(self, b: int) -> None:
        """Two eager steps on a side stream (allocations settle, torch.compile runs) before capture. A failing
        compiled path falls back to eager ops with a warning instead of failing the rollout."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._step(b, self.mode)
        except Exception as err:  # noqa: BLE001 — torch.compile/inductor failures are many types
            if not self.ops.is_compiled:
                raise
            logger.warning("compiled decode failed (%s: %s); using eager ops inside CUDA graphs",
                           type(err).__name__, err)
            self.ops = DecodeOps()
            self.graphs.clear()
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._step(b, self.mode)
        torch.cuda.current_stream().wait_stream(stream)

    # ------------------------------------------------------------------------------------------------- harvest
    def done_mask(self) -> torch.Tensor:
        """Host copy of `done` — the one synchronisation the scheduler makes every few steps."""
        return self.done.cpu()

    def harvest(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens [k, R], log-probs [k, R], lengths [k]) of finished slots; the slots become free."""
        idx = torch.tensor(slots, device=self.device)
        return self.out_tok[idx, : self.R], self.out_logp[idx, : self.R], self.step[idx].clone()
