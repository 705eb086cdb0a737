"""Sampling parameters and the on-device sampler.

Decision: noise is *counter-based*: a hash of (request seed, step, token id), never a torch.Generator. It lives
inside a CUDA graph, and a request's tokens depend only on its own seed and logits — never on which other requests
share the batch. Plain sampling is the Gumbel-max trick, token = argmax(logits / T + G) with G = -log(-log(u)) and
u = hash(seed, step, v): elementwise noise plus two reductions (argmax, logsumexp), which `torch.compile` fuses into
single passes over the vocab — no sort and no scan (an inverse-CDF sampler needs a cumsum over 151,936 logits,
~0.9 ms per decode step on an H200 and a construct Inductor failed to compile). top-k/top-p needs the sorted
distribution anyway, so it draws one uniform per row and inverts the CDF of the filtered, sorted probabilities.
Which implementation samples (`Sampler`: torch, compiled torch, or the Triton kernel of sample_kernel.py) is
decided once per engine by `build_sampler`; with tensor parallelism, `ShardedSampler` draws the same tokens from
each rank's vocab shard.

Legend: N rows being sampled, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hybridflow.rollout import sample_kernel
from hybridflow.rollout.tensor_parallel import TPContext
from hybridflow.utils.compile import GuardedCompile
from hybridflow.utils.triton_util import triton_available

if TYPE_CHECKING:
    from hybridflow.config.schema import RolloutConfig

logger = logging.getLogger(__name__)

_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2**27, so a 32-bit value times it never overflows int64
_GOLDEN = 0x9E3779B1
_GOLDEN_V = 0x85EBCA6B  # token-id stride; (v * it) stays < 2**63 for any vocab below 2**31
MODES = ("greedy", "sample", "filtered")  # filtered = top-k and/or top-p active (needs a sort over the vocab)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one generate call. `max_new_tokens=None` = the engine's max_response_length."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = True
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    max_new_tokens: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"sampling n={self.n} must be >= 1 (responses per prompt)")
        if self.do_sample and self.temperature <= 0:
            raise ValueError(f"sampling temperature={self.temperature} must be > 0; use do_sample=False for greedy")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling top_p={self.top_p} must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"sampling top_k={self.top_k} must be -1 (off) or >= 1")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"sampling max_new_tokens={self.max_new_tokens} must be >= 1")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def mode(self) -> str:
        if not self.do_sample:
            return "greedy"
        return "filtered" if (self.top_k > 0 or self.top_p < 1.0) else "sample"

    @classmethod
    def from_config(cls, rollout_cfg: RolloutConfig, validate: bool = False) -> SamplingParams:
        """From a `RolloutConfig`; `validate=True` uses `rollout.val_kwargs` (greedy by default)."""
        src = rollout_cfg.val_kwargs if validate else rollout_cfg
        return cls(n=src.n, temperature=src.temperature, top_k=src.top_k, top_p=src.top_p, do_sample=src.do_sample,
                   ignore_eos=rollout_cfg.ignore_eos, stop_token_ids=tuple(rollout_cfg.stop_token_ids),
                   seed=rollout_cfg.seed)

    def with_overrides(self, meta: Mapping[str, Any]) -> SamplingParams:
        """Apply the sampling keys present in a DataProto's meta_info (unknown keys are ignored)."""
        names = {f.name for f in dataclasses.fields(self)}
        upd = {k: v for k, v in meta.items() if k in names}
        return dataclasses.replace(self, **upd) if upd else self


# ------------------------------------------------------------------------------------------- counter-based noise
def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding values in [0, 2**32); no overflow anywhere."""
    x = (((x >> 16) ^ x) * _MIX) & _M32
    x = (((x >> 16) ^ x) * _MIX) & _M32
    return (x >> 16) ^ x


def _row_hash(seeds_N: torch.Tensor, steps_N: torch.Tensor) -> torch.Tensor:
    h = _mix32(seeds_N & _M32)
    h = _mix32(h ^ ((seeds_N >> 32) & _M32))
    return _mix32((h + (steps_N & 0x7FFFFFFF) * _GOLDEN) & _M32)


def uniform_from_counter(seeds_N: torch.Tensor, steps_N: torch.Tensor) -> torch.Tensor:
    """u[i] in [0, 1) (float32, 24 random bits) from (seed[i], step[i]) only — batch-invariant by construction."""
    return (_row_hash(seeds_N, steps_N) >> 8).to(torch.float32) * (1.0 / (1 << 24))


def gumbel_from_counter(seeds_N: torch.Tensor, steps_N: torch.Tensor, vocab: int, start: int = 0) -> torch.Tensor:
    """Standard Gumbel noise [N, vocab] (float32) from (seed[i], step[i], v) only, for token ids v in
    [start, start + vocab) (a tensor-parallel rank's shard draws the noise one device draws for those ids)."""
    v = torch.arange(start, start + vocab, device=seeds_N.device, dtype=torch.long)
    x = _mix32((_row_hash(seeds_N, steps_N)[:, None] + v[None, :] * _GOLDEN_V) & _M32)
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1): both logs stay finite
    return -torch.log(-torch.log(u))


def row_seed(seed: int, sample_index: int) -> int:
    """Seed of sample j of a prompt whose seed is `seed` (host-side 64-bit mix; positive int63)."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + (int(sample_index) + 1) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & ((1 << 64) - 1)
    x ^= x >> 29
    return x & ((1 << 63) - 1)


# ------------------------------------------------------------------------------------------------------ sampler
def _inverse_cdf(probs_NV: torch.Tensor, u_N: torch.Tensor) -> torch.Tensor:
    """Index j with cdf[j-1] <= u*total < cdf[j]; never lands on a zero-probability entry (except by clamp)."""
    cdf = torch.cumsum(probs_NV, dim=-1)
    target = (u_N * cdf[:, -1]).unsqueeze(-1)
    idx = (cdf <= target).sum(dim=-1)
    return idx.clamp_(max=probs_NV.shape[-1] - 1)


def sample(logits_NV: torch.Tensor, mode: str, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds_N: torch.Tensor, steps_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [N] int64, log-prob of each token under the sampling distribution [N] float32).

    `temperature`, `top_k` (V = off), `top_p` are 0-d device tensors so a captured CUDA graph serves any value.
    Greedy returns argmax and its log-prob under softmax(logits / temperature).
    """
    scaled = logits_NV.float() / temperature
    if mode == "greedy":
        tok = scaled.argmax(dim=-1)
        logp = scaled.gather(-1, tok[:, None]).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
        return tok, logp
    if mode == "sample":
        tok = (scaled + gumbel_from_counter(seeds_N, steps_N, scaled.shape[-1])).argmax(dim=-1)
        logp = scaled.gather(-1, tok[:, None]).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
        return tok, logp
    if mode != "filtered":
        raise ValueError(f"sampling mode={mode!r}; choose one of {MODES}")
    u = uniform_from_counter(seeds_N, steps_N)
    probs = torch.softmax(scaled, dim=-1)
    sorted_p, sorted_idx = torch.sort(probs, dim=-1, descending=True, stable=True)
    return _draw_sorted(sorted_p, sorted_idx, top_k, top_p, u)


def _draw_sorted(sorted_p: torch.Tensor, sorted_idx: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 u_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The `filtered` draw from probabilities sorted descending (ties in token order) and their token ids.
    Order as in HF generate: temperature, then top-k, then top-p on the renormalised top-k distribution."""
    rank = torch.arange(sorted_p.shape[-1], device=sorted_p.device)
    kept = sorted_p * (rank < top_k)
    z_k = kept.sum(dim=-1, keepdim=True)
    exclusive = torch.cumsum(kept, dim=-1) - kept
    kept = kept * (exclusive < top_p * z_k)
    z = kept.sum(dim=-1)
    j = _inverse_cdf(kept, u_N)
    p_j = kept.gather(-1, j[:, None]).squeeze(-1)
    tok = sorted_idx.gather(-1, j[:, None]).squeeze(-1)
    return tok, torch.log(p_j / z)


class Sampler(Protocol):
    """(token ids [N] int64, log-probs [N] float32) for logits [N, V]; the contract of `sample`, whose noise every
    implementation reproduces. `temperature`, `top_k`, `top_p` are 0-d device tensors (graph-captured)."""

    def __call__(self, logits_NV: torch.Tensor, mode: str, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, seeds_N: torch.Tensor, steps_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ...


def build_sampler(device: torch.device, compiled: bool) -> Sampler:
    """The engine's sampler, chosen once: on CUDA with Triton `kernel_sample` (the fused kernel); elsewhere
    `sample`, `torch.compile`d when `compiled` (one process-wide compiled copy, shapes specialised as the decode
    ops' are)."""
    if device.type == "cuda" and triton_available(device):
        return kernel_sample
    return _compiled_sample() if compiled else sample


@functools.lru_cache(maxsize=1)
def _compiled_sample() -> Sampler:
    return GuardedCompile(sample, "the rollout's sampler", dynamic=None)


def kernel_sample(logits_NV: torch.Tensor, mode: str, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, seeds_N: torch.Tensor, steps_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`greedy` and `sample` in the fused Triton kernel (`sample_kernel.fused_sample`, one pass over the vocab);
    `filtered` in `sample` (top-k/top-p needs the sorted distribution)."""
    if mode in sample_kernel.KERNEL_MODES:
        return sample_kernel.fused_sample(logits_NV, mode, temperature, top_k, top_p, seeds_N, steps_N)
    return sample(logits_NV, mode, temperature, top_k, top_p, seeds_N, steps_N)


def sampler_values(params: SamplingParams, vocab_size: int) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) for `sample`: greedy samples at temperature 1 (its log-probs are the plain
    softmax's), top_k off = the whole vocabulary. The model runner fills its graph-captured 0-d tensors with these."""
    temperature = params.temperature if params.do_sample else 1.0
    return temperature, params.top_k if params.top_k > 0 else vocab_size, params.top_p


class ShardedSampler:
    """`sample` over the vocab shards of a tensor-parallel group (`TPContext`), the logits never gathered: rank r
    holds logits [N, V/tp] of token ids [vocab_start, ...) (padding -inf) and every rank returns the same global ids.

    `greedy` / `sample`: each rank draws the noise one device would draw for its ids (`gumbel_from_counter` over
    its global columns), takes its best score, and one all-gather of 5 numbers a row (local max and sum of exp, best
    score, its id and logit; float64, exact for ids) lets every rank pick the winner (ties: the lowest id, as
    torch.argmax) and the global logsumexp of its log-prob. `filtered` (top-k / top-p): each rank contributes its
    `candidates` best entries in one all-gather (2 numbers each) and every rank runs `sample`'s sorted draw on the
    merged list — exact, since the global top-k is among the ranks' top-k. With top_k set that is tp·k entries a row;
    top-p alone needs the whole sorted distribution, so every rank gathers its full shard (V entries a row: what
    gathering the logits costs). The same tokens as `sample` up to fp32 rounding of the log-sum-exp (the Triton
    kernel's near-tie caveat applies against one GPU). Eager torch: chosen once per engine, like `build_sampler`'s."""

    def __init__(self, tp: TPContext) -> None:
        self.tp = tp
        self.candidates = tp.local.vocab  # entries a rank contributes in `filtered` (`set_top_k`)

    def set_top_k(self, top_k: int) -> bool:
        """The host value of top_k (<= 0: off) fixes the candidates per rank; True when that count changed (a
        captured `filtered` graph holds the old one)."""
        rows = self.tp.local.vocab
        candidates = min(top_k, rows) if top_k > 0 else rows
        changed, self.candidates = candidates != self.candidates, candidates
        return changed

    def __call__(self, logits_NV: torch.Tensor, mode: str, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, seeds_N: torch.Tensor, steps_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scaled = logits_NV.float() / temperature
        start = self.tp.vocab_start
        m = scaled.amax(dim=-1)
        s = torch.exp(scaled - m.nan_to_num(neginf=0.0)[:, None]).sum(dim=-1)  # a padding-only shard: m=-inf, s=0
        if mode == "filtered":
            return self._filtered(scaled, m, s, top_k, top_p, uniform_from_counter(seeds_N, steps_N))
        if mode not in MODES:
            raise ValueError(f"sampling mode={mode!r}; choose one of {MODES}")
        score = scaled if mode == "greedy" else scaled + gumbel_from_counter(seeds_N, steps_N, scaled.shape[-1], start)
        idx = score.argmax(dim=-1)
        best, x = score.gather(-1, idx[:, None])[:, 0], scaled.gather(-1, idx[:, None])[:, 0]
        g = self.tp.all_gather(torch.stack([t.double() for t in (m, s, best, x, idx + start)], dim=-1))  # [tp, N, 5]
        win = g[:, :, 2].argmax(dim=0)  # the first rank among equal scores holds the lowest id
        pick = g.gather(0, win[None, :, None].expand(1, -1, g.shape[-1]))[0]
        return pick[:, 4].long(), (pick[:, 3] - _logsumexp(g[:, :, 0], g[:, :, 1])).float()

    def _filtered(self, scaled: torch.Tensor, m: torch.Tensor, s: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, u_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        C, N = self.candidates, scaled.shape[0]
        vals, idx = torch.sort(scaled, dim=-1, descending=True, stable=True)
        part = torch.cat([vals[:, :C].double(), (idx[:, :C] + self.tp.vocab_start).double(), m[:, None].double(),
                          s[:, None].double()], dim=-1)
        g = self.tp.all_gather(part)  # [tp, N, 2C + 2]
        lse = _logsumexp(g[:, :, 2 * C], g[:, :, 2 * C + 1])
        # ranks in order, each sorted stably: equal probabilities stay in token-id order, as in `sample`
        probs = torch.exp(g[:, :, :C].transpose(0, 1).reshape(N, -1) - lse[:, None]).float()
        ids = g[:, :, C: 2 * C].transpose(0, 1).reshape(N, -1).long()
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        return _draw_sorted(sorted_p, ids.gather(-1, order), top_k, top_p, u_N)


def _logsumexp(m_RN: torch.Tensor, s_RN: torch.Tensor) -> torch.Tensor:
    """log sum_r s_r·exp(m_r) over the ranks' local maxima m and sums of exp(x - m) [tp, N]; a rank of padding
    only (m = -inf, s = 0) adds nothing."""
    top = m_RN.amax(dim=0)
    return top + torch.log((s_RN * torch.exp(m_RN - top)).sum(dim=0))
