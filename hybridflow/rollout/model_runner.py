"""Device-side decode state per KV slot, the decode step (forward + sampler + bookkeeping) and its CUDA graphs.

Everything a step needs lives in static per-slot buffers, so one step is a fixed sequence of kernels over the
first `b` slots attending to the first `L` cache columns: it is captured once per (batch bucket, KV-length bucket,
sampling mode) as a CUDA graph, on first use, and replayed with no host synchronisation; the host reads `done`
only when the scheduler asks. Finished rows keep running (masked) until then — cheaper than a sync per token.
KV-length buckets (~1.4x apart) keep the bytes read per step near the live context, not the full slot length.

Legend: S slots, T cache columns, R max new tokens (+1 trash column for writes of finished rows), V vocab.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy
import torch

from hybridflow.engine import invariant
from hybridflow.rollout import exact_forward, forward, moe, vision
from hybridflow.rollout.forward import EAGER_OPS, DecodeOps, RopeTable
from hybridflow.rollout.kv_cache import KVCache
from hybridflow.rollout.sampling import Sampler, SamplingParams, ShardedSampler, sample, sampler_values
from hybridflow.rollout.tensor_parallel import TPContext
from hybridflow.rollout.weights import ArchSpec, ModelWeights
from hybridflow.utils.device import to_device

logger = logging.getLogger(__name__)

# A smaller bucket is captured mid-generation only if at least this many steps remain (capture ≈ 2 eager steps).
CAPTURE_MIN_REMAINING = 32
# Multi-turn extensions of up to this many new tokens (all slots together) replay CUDA graphs captured per
# (token bucket, slot bucket) on a bucket's second use (a capture costs ~3 eager calls; one-off shapes stay eager).
EXT_GRAPH_TOKENS = 4096
EXT_CAPTURE_AFTER_USES = 2


def buckets_for(slots: int) -> list[int]:
    """Decode batch sizes with a graph: powers of two from 8, and `slots` itself."""
    out, b = [], 8
    while b < slots:
        out.append(b)
        b *= 2
    return out + [slots]


def kv_buckets_for(max_len: int) -> list[int]:
    """Attended cache lengths: 128, 192, 256, 384, 512, 768, ... (multiples of 16, ≤ 1.5x apart), and max_len."""
    out, x, grow = [], 128, 1.5
    while x < max_len:
        out.append(x)
        x = int(x * grow) // 16 * 16
        grow = 4 / 3 if grow == 1.5 else 1.5
    return out + [max_len]


def _pow2(x: int, floor: int) -> int:
    """The power of two >= max(x, floor)."""
    return max(floor, 1 << (x - 1).bit_length())


def on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A long tensor of host-known values on `device` without waiting for the queued kernels
    (`torch.tensor(values, device=cuda)` syncs the stream — and gives the interpreter lock away to get its answer
    back); the values go through pinned memory, so the copy is asynchronous."""
    return to_device(torch.tensor(values, dtype=torch.long), device)


class Readout:
    """Host copies of device tensors, made after the work queued so far on the current stream: on a GPU into pinned
    memory, asynchronously (an event marks their arrival; `wait` blocks on it, not on later work); on a CPU at once."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.event: torch.cuda.Event | None = None
        if tensors[0].device.type == "cuda":
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(self.host, tensors):
                h.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = [t.clone() for t in tensors]

    def wait(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.host


class ModelRunner:
    """Owns the KV cache and slot state; `admit` prefills prompts into slots, `step_` decodes all live slots.
    `ops` (the forward's pieces) and `sampler` are the engine's choice for its device. With `tp` (tensor
    parallelism) `spec`, `weights` and `cache` are this rank's (`tp.local`), the ops get the group's pieces and the
    sampler is a `ShardedSampler`; token ids, stop ids and top_k stay global (`vocab`)."""

    def __init__(self, spec: ArchSpec, weights: ModelWeights, rope: RopeTable, cache: KVCache, *, pad_id: int,
                 max_new_tokens: int, use_graphs: bool, ops: DecodeOps, sampler: Sampler,
                 tp: TPContext | None = None, exact: bool = False, image_token_id: int | None = None,
                 suppress: Sequence[int] = ()) -> None:
        self.spec, self.weights, self.rope, self.cache = spec, weights, rope, cache
        self.image_token_id = image_token_id  # vision-language prompts: image embeddings replace these tokens'
        # exact log-probs (actor_rollout.exact_logprobs): every forward is `exact_forward.forward_tokens` and each
        # sampled token's log-prob is `invariant.token_logprobs` of the full softmax — the trainer's bits
        self.exact = exact
        self.tp = tp
        self.vocab = spec.vocab if tp is None else tp.spec.vocab
        # prefill and the SDPA extension run eagerly; a failed capture falls back to these as well
        self.eager_ops = EAGER_OPS if tp is None else tp.decode_ops(EAGER_OPS)
        self.ops: DecodeOps = ops if tp is None else tp.decode_ops(ops)
        # Prefill compiled when decode is (dense, one rank: MoE records routes and TP all-reduces eagerly there).
        dense = all(lw.moe is None for lw in weights.layers)
        self.prefill_ops = forward.compiled_prefill_ops() if ops.is_compiled and tp is None and dense \
            else self.eager_ops
        self.sampler: Sampler = sampler
        self._eager_sampler: Sampler = sample if tp is None else sampler
        self.pad_id, self.R, self.use_graphs = pad_id, max_new_tokens, use_graphs
        S, T = cache.slots, cache.max_len
        dev = cache.k[0].device
        self.device = dev
        zeros = dict(dtype=torch.long, device=dev)
        # resp_len: each slot's response length so far = the index of its next token in `out_tok` and the
        # sampler's counter for it
        self.tok, self.pos, self.cidx, self.resp_len = (torch.zeros(S, **zeros) for _ in range(4))
        self.start = torch.zeros(S, **zeros)  # first valid cache column of each slot (after the left padding)
        self.seed, self.max_new = torch.zeros(S, **zeros), torch.full((S,), max_new_tokens, **zeros)
        self.done = torch.ones(S, dtype=torch.bool, device=dev)
        self.valid = torch.zeros(S, T, dtype=torch.bool, device=dev)
        self.out_tok = torch.full((S, max_new_tokens + 1), pad_id, **zeros)
        self.out_logp = torch.zeros(S, max_new_tokens + 1, dtype=torch.float32, device=dev)
        self.temperature = torch.ones((), dtype=torch.float32, device=dev)
        self.top_k = torch.tensor(self.vocab, device=dev)
        self.top_p = torch.ones((), dtype=torch.float32, device=dev)
        self.is_stop = torch.zeros(self.vocab, dtype=torch.bool, device=dev)  # vocab lookup: any number of stop ids
        # token ids never sampled (a vision-language model's vision tokens), None when there are none
        self.suppress = None
        if suppress:
            self.suppress = torch.zeros(self.vocab, dtype=torch.bool, device=dev)
            self.suppress[torch.tensor(list(suppress), device=dev)] = True
        self.mode = "sample"
        self.graphs: dict[tuple[int, int, str], torch.cuda.CUDAGraph] = {}  # (b, L, mode) -> graph
        self._pool = None
        self.buckets = buckets_for(S)
        self.kv_buckets = kv_buckets_for(T)
        self.capture_s = 0.0  # time of the last capture() that captured anything
        # extension graphs: (tokens bucket, slots bucket) -> (graph, logits); their static inputs [ids, pos, slot,
        # col] and each slot's last-token index
        self.ext_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.routes = moe.route_buffer(weights.layers, S, T, dev)  # MoE: experts of each slot's cache columns
        self.ext_graph_tokens = EXT_GRAPH_TOKENS if use_graphs else 0  # 0: extensions run eagerly
        self._ext_uses: dict[tuple[int, int], int] = {}
        self._ext_in: torch.Tensor | None = None
        self._ext_last: torch.Tensor | None = None
        self._side: torch.cuda.Stream | None = None  # `finished_rows`' gathers
        self._true = torch.ones((), dtype=torch.bool, device=dev)  # index_put_ values (no host copy)
        self._zero = torch.zeros((), dtype=torch.float32, device=dev)

    # ------------------------------------------------------------------------------------------- configuration
    def set_sampling(self, params: SamplingParams, eos_ids: list[int]) -> None:
        stops = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids)))
        bad = [t for t in stops if not 0 <= t < self.vocab]
        if bad:
            raise ValueError(f"stop/eos token ids {bad} are outside the vocabulary [0, {self.vocab})")
        self.is_stop.fill_(False)
        if stops:
            self.is_stop[torch.tensor(stops, device=self.device)] = True
        temperature, top_k, top_p = sampler_values(params, self.vocab)
        self.temperature.fill_(temperature)
        self.top_k.fill_(top_k)
        self.top_p.fill_(top_p)
        self.mode = params.mode
        if isinstance(self.sampler, ShardedSampler) and self.sampler.set_top_k(params.top_k):
            self.graphs = {key: g for key, g in self.graphs.items() if key[2] != "filtered"}

    def set_weights(self, weights: ModelWeights) -> None:
        """New views; captured graphs are dropped only if any tensor moved (zero-copy weights never move)."""
        if weights.ptrs != self.weights.ptrs and (self.graphs or self.ext_graphs):
            logger.info("weight storage moved; dropping %d CUDA graphs", len(self.graphs) + len(self.ext_graphs))
            self.graphs.clear()
            self.ext_graphs.clear()
        self.weights = weights

    # -------------------------------------------------------------------------------------------------- prefill
    def admit(self, slots: list[int], ids_BP: torch.Tensor, mask_BP: torch.Tensor, pos_BP: torch.Tensor, n: int,
              seeds: list[int], max_new: int, image_NH: torch.Tensor | None = None) -> None:
        """Prefill B prompts once, give prompt i the n slots slots[i*n:(i+1)*n], sample each slot's first token.
        Vision-language prompts: `pos_BP` is [B, P, 3] (mrope) and `image_NH` the embeddings of their image pads."""
        B, P = ids_BP.shape
        assert len(slots) == B * n == len(seeds), (len(slots), B, n, len(seeds))
        assert P + max_new <= self.cache.max_len, (P, max_new, self.cache.max_len)
        dev = self.device
        slot_t = on_device(slots, dev)
        src = torch.arange(B, device=dev).repeat_interleave(n)
        embeds = None
        if image_NH is not None:
            x = forward.scaled(self.prefill_ops.embed(ids_BP, self.weights.embed), self.spec.embed_scale)
            embeds = vision.input_embeds(x, ids_BP, image_NH, self.image_token_id)
        with moe.recording(self.weights.layers) as sinks:
            logits = (self._prefill_exact(ids_BP, mask_BP, pos_BP, slot_t, src, n) if self.exact else
                      forward.prefill(self.weights, self.spec, self.rope, ids_BP, mask_BP, pos_BP, self.cache, slot_t,
                                      src, self.prefill_ops, embeds))
        if self.routes is not None:
            self.routes[slot_t, :P] = moe.stacked(sinks, B, P)[src]
        seeds_t = on_device(seeds, dev)
        tok, logp = self._sample(logits[src], seeds_t, torch.zeros_like(seeds_t))
        # scalars go in as kernel arguments (index_fill_) or device tensors: `t[idx] = 1` copies the 1 from
        # pageable memory, which waits for every queued step
        self.valid.index_fill_(0, slot_t, False)
        self.valid[slot_t, :P] = mask_BP.bool()[src]
        self.start[slot_t] = (P - mask_BP.long().sum(-1))[src]
        self.out_tok.index_fill_(0, slot_t, self.pad_id)
        self.out_logp.index_fill_(0, slot_t, 0.0)
        self.out_tok[slot_t, 0] = tok
        self.out_logp[slot_t, 0] = logp
        self.seed[slot_t] = seeds_t
        self.tok[slot_t] = tok
        # mrope: decoding continues at the prompt's largest position + 1 (HF's rope_deltas), the same for t, h, w
        self.pos[slot_t] = (pos_BP.amax((1, 2)) if pos_BP.dim() == 3 else pos_BP[:, -1])[src] + 1
        self.cidx.index_fill_(0, slot_t, P)
        self.resp_len.index_fill_(0, slot_t, 1)
        self.max_new.index_fill_(0, slot_t, max_new)
        stop = self.is_stop[tok]
        self.done[slot_t] = stop | (max_new <= 1)

    def extend_many(self, items: list[tuple[int, list[int], int]], prompt_width: int, *,
                    steps: list[int] | None = None, max_new: list[int] | None = None) -> list[int]:
        """Multi-turn: for each (slot, new_ids, resp_pos0), append `new_ids` (tool/user tokens) to that finished
        slot's response, prefill only them (and the turn's last sampled token, whose K/V no step wrote yet) — all
        slots in one batched forward — sample each slot's next model token and make the slots live again. Returns
        the new response lengths. A waiting slot's `tok`/`pos`/`cidx`/`valid` drifted (finished rows keep stepping,
        masked), so they are rebuilt from `resp_len`, which never drifts.

        With a range-attention kernel (`ops.attention`, the GPU path) the new tokens run flat through
        `forward.extend_ranged`; otherwise through `forward.extend_batch` (SDPA over a padded [slots, tokens]
        layout). Everything but the first token of each slot is known on the host, so the indices are built there
        and copied once. `steps` / `max_new` (each slot's response length and cap) are read from the device when
        the caller does not know them — a sync that drains the queued decode steps first."""
        dev = self.device
        slots = [s for s, _, _ in items]
        slots_t = on_device(slots, dev)
        if steps is None or max_new is None:
            steps, max_new = torch.stack([self.resp_len[slots_t], self.max_new[slots_t]]).tolist()
        else:  # the caller's caps for this turn
            self.max_new[slots_t] = on_device(max_new, dev)
        for (s, new_ids, _), step, mx in zip(items, steps, max_new):
            assert step + len(new_ids) < mx, (s, step, len(new_ids), mx)
        col0 = [prompt_width + st - 1 for st in steps]  # the column of response token step - 1 (re-fed)
        cols = torch.arange(self.valid.shape[1], device=dev)
        self.valid[slots_t] &= cols[None] < on_device(col0, dev)[:, None]
        if self.exact:
            logits = self._extend_exact(items, steps, col0, slots_t)
        elif self.ops.attention is not None:
            logits = self._extend_ranged(items, steps, col0, slots_t)
        else:
            logits = self._extend_sdpa(items, steps, col0, slots_t)
        # Bookkeeping, all host-known but the sampled tokens: appended ids land in the output (log-prob 0), the
        # sampled token after them, and the slot's decode state moves past the new tokens.
        k = [len(ids) for _, ids, _ in items]
        app = torch.tensor([[s for s, n in zip(slots, k) for _ in range(n)],
                            [st + j for st, n in zip(steps, k) for j in range(n)],
                            [t for _, ids, _ in items for t in ids]], dtype=torch.long)
        per_slot = torch.tensor([[st + n for st, n in zip(steps, k)],  # the sampler's step = the token's index
                                 [c + n + 1 for c, n in zip(col0, k)],  # next cache column
                                 [p + st + n for (_, _, p), st, n in zip(items, steps, k)]],  # next position
                                dtype=torch.long)
        app, per_slot = to_device(app, dev), to_device(per_slot, dev)  # pinned: no wait for queued steps
        counter, next_col, next_pos = per_slot
        self.out_tok[app[0], app[1]] = app[2]
        self.out_logp.index_put_((app[0], app[1]), self._zero)
        tok, logp = self._sample(logits, self.seed[slots_t], counter)
        self.out_tok[slots_t, counter] = tok
        self.out_logp[slots_t, counter] = logp
        new_len = counter + 1
        self.tok[slots_t], self.resp_len[slots_t] = tok, new_len
        self.cidx[slots_t], self.pos[slots_t] = next_col, next_pos
        self.done[slots_t] = self.is_stop[tok] | (new_len >= self.max_new[slots_t])
        return [st + n + 1 for st, n in zip(steps, k)]  # = new_len, known on the host

    def _extend_ranged(self, items: list[tuple[int, list[int], int]], steps: list[int], col0: list[int],
                       slots_t: torch.Tensor) -> torch.Tensor:
        """The new tokens of every slot as one flat batch (`forward.extend_ranged`); logits [S, V]. On a GPU the
        batch is padded to a (tokens, slots) bucket — extra tokens repeat the last one (identical K/V writes),
        extra slots repeat the last slot's logits row — and replays that bucket's CUDA graph once captured."""
        dev = self.device
        ids, pos, slot, col, first, last = [], [], [], [], [], []
        for (s, new_ids, resp_pos0), st, c in zip(items, steps, col0):
            first.append(len(ids))
            n = len(new_ids) + 1
            ids += [0, *new_ids]  # the re-fed sampled token is filled in on the device below
            pos += range(resp_pos0 + st - 1, resp_pos0 + st - 1 + n)
            slot += [s] * n
            col += range(c, c + n)
            last.append(len(ids) - 1)
        N, S = len(ids), len(items)
        key = (_pow2(N, 64), _pow2(S, 8)) if N <= self.ext_graph_tokens else None
        if key is not None:
            Nb, Sb = key
            for lst in (ids, pos, slot, col):
                lst += [lst[-1]] * (Nb - N)
            last += [last[-1]] * (Sb - S)
        # every host tensor goes through pinned memory: a copy from pageable memory waits for the queued decode
        # steps, which the agent server keeps running while it admits the next requests
        host = torch.tensor([ids, pos, slot, col], dtype=torch.long)
        idx = to_device(torch.tensor([first, last[:S]], dtype=torch.long), dev)
        if dev.type == "cuda":
            host = host.pin_memory()
        if key is None:
            buf, last_t = host.to(dev, non_blocking=True), idx[1]
        else:
            if self._ext_in is None:
                self._ext_in = torch.zeros(4, self.ext_graph_tokens, dtype=torch.long, device=dev)
                self._ext_last = torch.zeros(_pow2(self.cache.slots, 8), dtype=torch.long, device=dev)
            buf, last_t = self._ext_in[:, : key[0]], self._ext_last[: key[1]]
            buf.copy_(host, non_blocking=True)
            last_t.copy_(to_device(torch.tensor(last, dtype=torch.long), dev))
        buf[0, idx[0]] = self.out_tok[slots_t, on_device(steps, dev) - 1]
        self.valid.index_put_((buf[2, :N], buf[3, :N]), self._true)
        if key is None:
            return self._extend_forward(buf, last_t)
        graph = self.ext_graphs.get(key)
        if graph is None:
            self._ext_uses[key] = self._ext_uses.get(key, 0) + 1
            if self._ext_uses[key] < EXT_CAPTURE_AFTER_USES or not self._capture_extension(key, buf, last_t):
                return self._extend_forward(buf, last_t)[:S]
            graph = self.ext_graphs[key]
        graph[0].replay()
        return graph[1][:S]

    def _extend_forward(self, buf: torch.Tensor, last_t: torch.Tensor) -> torch.Tensor:
        ids_N, pos_N, slot_N, col_N = buf
        return forward.extend_ranged(self.weights, self.spec, self.rope, self.ops, ids_N, pos_N, slot_N, col_N,
                                     self.start[slot_N], last_t, self.cache)

    def _capture_extension(self, key: tuple[int, int], buf: torch.Tensor, last_t: torch.Tensor) -> bool:
        """Capture the extension over `key`'s static inputs (already holding this call's tokens, so the warm-up run
        writes the K/V the replay writes again). False, with a warning and extensions eager from then on, if
        capture fails."""
        t0 = time.perf_counter()
        try:
            graph, logits = self._graph(lambda: self._extend_forward(buf, last_t), warmups=1)
        except Exception as err:  # noqa: BLE001 — capture/compile failures are many types; eager still works
            logger.warning("CUDA-graph capture of a multi-turn extension failed (%s: %s); extensions run eagerly",
                           type(err).__name__, err)
            torch.cuda.synchronize()
            self.ext_graph_tokens = 0
            return False
        self.ext_graphs[key] = (graph, logits)
        self.capture_s += time.perf_counter() - t0
        logger.info("captured extension graph tokens=%d slots=%d in %.2fs", *key, time.perf_counter() - t0)
        return True

    def _extend_sdpa(self, items: list[tuple[int, list[int], int]], steps: list[int], col0: list[int],
                     slots_t: torch.Tensor) -> torch.Tensor:
        """The new tokens right-padded to [S, K] through `forward.extend_batch` (SDPA); logits [S, V]."""
        dev = self.device
        lens = [len(ids) + 1 for _, ids, _ in items]
        K = max(lens)
        ids = torch.full((len(items), K), self.pad_id, dtype=torch.long)
        pos = torch.zeros(len(items), K, dtype=torch.long)
        for i, (_, new_ids, resp_pos0) in enumerate(items):
            k = len(new_ids)
            ids[i, 1: k + 1] = torch.tensor(new_ids, dtype=torch.long)
            first = resp_pos0 + steps[i] - 1
            pos[i] = torch.arange(first, first + K).clamp(max=first + k)  # padding repeats the last position
        ids, pos = ids.to(dev, non_blocking=True), pos.to(dev, non_blocking=True)
        ids[:, 0] = self.out_tok[slots_t, on_device(steps, dev) - 1]
        return forward.extend_batch(self.weights, self.spec, self.rope, ids, pos, lens, self.cache, slots_t, col0,
                                    self.valid, self.eager_ops)

    def _prefill_exact(self, ids_BP: torch.Tensor, mask_BP: torch.Tensor, pos_BP: torch.Tensor,
                       slot_t: torch.Tensor, src: torch.Tensor, n: int) -> torch.Tensor:
        """Prefill through `exact_forward` into each prompt's first slot, then copy its K/V columns to the other
        n - 1; last logits [B, V]."""
        P = ids_BP.shape[1]
        valid = mask_BP.bool()
        b_idx, p_idx = valid.nonzero(as_tuple=True)  # prompt after prompt; each ends at column P - 1
        first = slot_t[::n]
        last = torch.cumsum(valid.sum(-1), 0) - 1
        logits = exact_forward.forward_tokens(self.weights, self.spec, self.rope, ids_BP[b_idx, p_idx],
                                              pos_BP[b_idx, p_idx], first[b_idx], p_idx, (P - valid.sum(-1))[b_idx],
                                              last, self.cache)
        if n > 1:
            for kc, vc in zip(self.cache.k, self.cache.v):
                kc[slot_t, :, :P] = kc[first[src], :, :P]
                vc[slot_t, :, :P] = vc[first[src], :, :P]
        return logits

    def _extend_exact(self, items: list[tuple[int, list[int], int]], steps: list[int], col0: list[int],
                      slots_t: torch.Tensor) -> torch.Tensor:
        """The new tokens of every slot (and each turn's re-fed last token) flat through `exact_forward`."""
        dev = self.device
        ids, pos, slot, col, first, last = [], [], [], [], [], []
        for (s, new_ids, resp_pos0), st, c in zip(items, steps, col0):
            first.append(len(ids))
            ids += [0, *new_ids]  # the re-fed sampled token is filled in on the device below
            pos += range(resp_pos0 + st - 1, resp_pos0 + st + len(new_ids))
            slot += [s] * (len(new_ids) + 1)
            col += range(c, c + len(new_ids) + 1)
            last.append(len(ids) - 1)
        ids_N, pos_N, slot_N, col_N = torch.tensor([ids, pos, slot, col], dtype=torch.long).to(dev)
        ids_N[torch.tensor(first, device=dev)] = self.out_tok[slots_t, torch.tensor(steps, device=dev) - 1]
        self.valid[slot_N, col_N] = True
        return exact_forward.forward_tokens(self.weights, self.spec, self.rope, ids_N, pos_N, slot_N, col_N,
                                            self.start[slot_N], torch.tensor(last, device=dev), self.cache)

    def _sample(self, logits: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                mode: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampler's (tokens, log-probs); in exact mode the log-prob of the full softmax at the temperature,
        as the trainer computes it (under top-k / top-p too, where the sampler reports the filtered one)."""
        if self.suppress is not None:
            logits = logits.masked_fill(self.suppress, float("-inf"))
        tok, logp = self.sampler(logits, mode or self.mode, self.temperature, self.top_k, self.top_p, seeds, steps)
        if self.exact:
            logp = invariant.token_logprobs(logits, tok, self.temperature)
        return tok, logp

    # --------------------------------------------------------------------------------------------------- decode
    def _eager_step(self, b: int, L: int, mode: str) -> None:
        T = self.cache.max_len
        with moe.recording(self.weights.layers) as sinks:
            if self.exact:
                rows = torch.arange(b, device=self.device)
                self.valid[:b].scatter_(1, self.cidx[:b, None], True)
                logits = exact_forward.forward_tokens(self.weights, self.spec, self.rope, self.tok[:b], self.pos[:b],
                                                      rows, self.cidx[:b], self.start[:b], rows, self.cache, L)
            else:
                logits = forward.decode(self.weights, self.spec, self.rope, self.ops, self.tok[:b], self.pos[:b],
                                        self.cidx[:b], self.valid[:b], self.start[:b], self.cache, L)
        if self.routes is not None:  # captured with the step: the graph replays the write
            self.routes[torch.arange(b, device=self.device), self.cidx[:b]] = moe.stacked(sinks, b)
        resp_len, done = self.resp_len[:b], self.done[:b]
        tok, logp = self._sample(logits, self.seed[:b], resp_len, mode)
        live = ~done
        col = torch.where(live, resp_len, self.R)[:, None]  # finished rows write into the trash column R
        self.out_tok[:b].scatter_(1, col, tok[:, None])
        self.out_logp[:b].scatter_(1, col, logp[:, None])
        new_len = resp_len + live.long()
        stop = self.is_stop[tok]
        done |= live & (stop | (new_len >= self.max_new[:b]))
        resp_len.copy_(new_len)
        self.tok[:b].copy_(tok)
        self.pos[:b].add_(1).clamp_(max=self.rope.max_len - 1)
        self.cidx[:b].add_(1).clamp_(max=T - 1)

    def shape(self, highest_live_slot: int, remaining_steps: int, kv_needed: int) -> tuple[int, int]:
        """(b, L) for the next steps: slots [0, highest_live_slot] attending to >= kv_needed columns. Captures that
        graph on first use, unless a larger captured one can finish the last few steps (capture ≈ 2 eager steps)."""
        # The host bound can overshoot T when requests entered at different steps; live columns never do.
        L = next(x for x in self.kv_buckets if x >= min(kv_needed, self.cache.max_len))
        if not self.use_graphs:
            return highest_live_slot + 1, L
        b = next(x for x in self.buckets if x > highest_live_slot)
        if (b, L, self.mode) in self.graphs:
            return b, L
        larger = sorted((bb * LL, bb, LL) for bb, LL, m in self.graphs if m == self.mode and bb >= b and LL >= L)
        if larger and remaining_steps < CAPTURE_MIN_REMAINING:
            return larger[0][1], larger[0][2]
        self.ensure_graph(b, L)
        return (b, L) if self.use_graphs else (highest_live_slot + 1, L)

    def step_(self, b: int, L: int) -> None:
        """One decode step over slots [0, b) and cache columns [0, L): a graph replay when captured, else eager."""
        graph = self.graphs.get((b, L, self.mode)) if self.use_graphs else None
        if graph is None:
            self._eager_step(b, L, self.mode)
        else:
            graph.replay()

    def _state(self) -> list[torch.Tensor]:
        return [self.tok, self.pos, self.cidx, self.resp_len, self.done, self.valid, self.out_tok, self.out_logp]

    def ensure_graph(self, b: int, L: int) -> None:
        """Capture the step over slots [0, b) and columns [0, L). Warm-up steps run for real, so the slot state is snapshotted and
        restored; their K/V writes land at columns the real steps overwrite before reading. If capturing compiled
        ops fails, retry with eager ops; if that fails too, decode eagerly — each with a warning."""
        t0 = time.perf_counter()
        snapshot = [t[:b].clone() for t in self._state()]
        try:
            self._capture(b, L)
        except Exception as err:  # noqa: BLE001 — torch.compile/inductor/capture failures are many types
            for t, saved in zip(self._state(), snapshot):
                t[:b].copy_(saved)
            self.graphs.clear()
            self.ext_graphs.clear()
            if self.ops.is_compiled or self.ops.attention is not None or self.sampler is not self._eager_sampler:
                logger.warning("CUDA-graph capture with compiled ops / Triton kernels failed (%s: %s); retrying "
                               "with eager torch ops", type(err).__name__, err)
                self.ops, self.sampler = self.eager_ops, self._eager_sampler
                self.ensure_graph(b, L)
                return
            logger.warning("CUDA-graph capture failed (%s: %s); decoding eagerly (slow)", type(err).__name__, err)
            self.use_graphs = False
            return
        for t, saved in zip(self._state(), snapshot):
            t[:b].copy_(saved)
        self.capture_s += time.perf_counter() - t0
        logger.info("captured decode graph b=%d L=%d mode=%s in %.2fs (compiled ops: %s)", b, L, self.mode,
                    time.perf_counter() - t0, self.ops.is_compiled)

    def _capture(self, b: int, L: int) -> None:
        graph, _ = self._graph(lambda: self._eager_step(b, L, self.mode), warmups=2)
        torch.cuda.synchronize()
        self.graphs[(b, L, self.mode)] = graph

    def _graph(self, fn: Callable[[], object], warmups: int) -> tuple[torch.cuda.CUDAGraph, object]:
        """`fn` captured into a CUDA graph in the runner's memory pool, after `warmups` real runs on a side stream
        (allocations settle, torch.compile and Triton compile there, not in the capture); (graph, fn's output)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmups):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn()
        return graph, out

    # ------------------------------------------------------------------------------------------------- harvest
    def done_mask(self) -> torch.Tensor:
        """Host copy of `done` — the one synchronisation the scheduler makes every few steps."""
        return self.done.cpu()

    def done_and_steps(self) -> tuple[numpy.ndarray, numpy.ndarray]:
        """Host copies of `done` and `resp_len` (each slot's response length) in one transfer."""
        both = torch.stack([self.done.long(), self.resp_len]).cpu().numpy()
        return both[0].astype(bool), both[1]

    def readout(self) -> Readout:
        """`done` and `resp_len` as they will be after the steps queued so far, copied to the host without waiting
        for them (`Readout.wait` does)."""
        return Readout(torch.stack([self.done.long(), self.resp_len]))

    def finished_rows(self, slots: list[int], upto: int, after: Readout) -> tuple[list[list[int]], list[list[float]]]:
        """Tokens and log-probs [:upto] of `slots`, finished as of `after` (already waited for), read while later
        queued steps may still run: on a GPU the gather runs on a side stream ordered after `after` only. Safe
        because a finished slot's row changes again only when it is admitted anew, and its masked steps write
        column R (the trash column), past `upto`."""
        if self.device.type != "cuda":
            idx = torch.tensor(slots, dtype=torch.long)
            return self.out_tok[idx, :upto].tolist(), self.out_logp[idx, :upto].tolist()
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._side):
            self._side.wait_event(after.event)
            idx = on_device(slots, self.device)
            rows = Readout(self.out_tok[idx, :upto], self.out_logp[idx, :upto])
        rows.event.synchronize()
        return rows.host[0].tolist(), rows.host[1].tolist()

    def harvest(self, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens [k, R], log-probs [k, R], lengths [k]) of finished slots; the slots become free."""
        idx = on_device(slots, self.device)
        return self.out_tok[idx, : self.R], self.out_logp[idx, : self.R], self.resp_len[idx].clone()
