"""The decode sampler as two Triton kernels: Gumbel-max (or argmax) and the log-prob in one pass over the vocab.

Same contract and noise as `sampling.sample` for the `sample` and `greedy` modes (`sampling.build_sampler` picks
this kernel once per engine on CUDA with Triton; `filtered` stays in torch there): token = argmax(logits / T + G),
G = -log(-log(u)), u from the 32-bit counter hash of (seed, step, token id); log-prob = logits[tok] / T -
logsumexp(logits / T). `_partial_kernel` runs (row, split) programs, each walking ~SPLIT_V vocab entries in BLOCK_V
chunks with the best score and its index per lane and an online logsumexp; `_combine_kernel`
merges a row's splits. So the [rows, vocab] noise and fp32 copies never exist (the eager torch version runs ~15
kernels over 256 × 151,936 int64/fp32 elements per step; Inductor failed to compile it on torch 2.11), and the
vocab is spread over ~19 programs per row (one program per row read HBM at ~0.5 TB/s). The argmax is exact and
ties go to the lowest index (as torch.argmax) however the vocab is split, so the split count never changes a token;
it only reorders the logsumexp's fp32 sum. The hash runs in uint32, whose wrapping multiply equals the
int64-and-mask arithmetic of `sampling._mix32`, so the noise is bit-identical; `log` may differ from torch's in the
last ulp, so a near-tie can resolve differently between this kernel and the torch path (each is deterministic on
its own). `filtered` (top-k / top-p) needs a sort and stays in torch (`sampling.kernel_sample`).

The draw is the exponential race (`_chunk`): argmax exp(x - m) / E with E = -log(u), the same argmax as
x - log(-log u) in exact arithmetic with one log per entry instead of two, and one running max per program (one exp
per chunk to rescale, not one per entry); rounding differs from the torch path, so the near-tie caveat above
applies. H200 sweep (`benchmarks/sampler.py`, 256 × 151,936 bf16): 113.6 µs per call at BLOCK_V 1024 × 4 warps; the
read alone is 36.7 µs; the former Gumbel kernel (per-lane max, two logs) measured ~153 µs.
"""
from __future__ import annotations

import torch

from hybridflow.utils.triton_util import INTERPRETED, jit, tl, triton

BLOCK_V = 1024  # vocab entries per loop iteration of a program (H200 sweep: 1024 × 4 warps fastest)
SPLIT_V = 8192  # vocab entries per program: ~19 programs per row at V = 151,936
WARPS = 4
KERNEL_MODES = ("greedy", "sample")  # `filtered` needs a sort over the vocab: `sampling.sample`


@jit
def _mix32(x):
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@jit
def _chunk(row_ptr, start, V, temp, h, offs, best, best_idx, m, s, GUMBEL: tl.constexpr):
    """Fold vocab entries [start, start + BLOCK) into the program's state: one running max `m` (a scalar: one exp
    per chunk to rescale, not one per entry), the per-lane logsumexp terms `s`, and per lane the best score and its
    token id. Sampling draws by the exponential race: token = argmax exp(x - m) / E with E = -log(u) ~ Exp(1), the
    same argmax as Gumbel's x - log(-log u) (log is monotone) with one log per entry, and exp(x - m) is the
    logsumexp's own term; `best` then holds exp(x - m) / E relative to the current `m` (rescaled with it)."""
    idx = start + offs
    mask = idx < V
    x = tl.load(row_ptr + idx, mask=mask, other=float("-inf")).to(tl.float32) / temp
    m_new = tl.maximum(m, tl.max(x, 0))
    alpha = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
    p = tl.where(x > float("-inf"), tl.exp(x - m_new), 0.0)
    s = s * alpha + p
    if GUMBEL:
        e = _mix32(h + idx.to(tl.uint32) * 0x85EBCA6B)
        u = ((e >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        y = tl.where(x > float("-inf"), p / -tl.log(u), -1.0)  # -inf and out-of-range entries never win
        best = best * alpha
    else:
        y = tl.where(mask, x, float("-inf"))
    better = y > best  # strict: the earliest chunk wins ties, as torch.argmax's first index
    return tl.where(better, y, best), tl.where(better, idx, best_idx), m_new, s


@jit
def _partial_kernel(Logits, stride_row, V, chunk, Temp, Seeds, Steps, Best, BestIdx, M, S, GUMBEL: tl.constexpr,
                    BLOCK: tl.constexpr, WHILE_LOOP: tl.constexpr):
    """Program (row, split) over vocab [split * chunk, (split + 1) * chunk): its winner and logsumexp partial."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_ptr = Logits + row.to(tl.int64) * stride_row
    temp = tl.load(Temp).to(tl.float32)
    h = tl.zeros([], dtype=tl.uint32)
    if GUMBEL:
        seed = tl.load(Seeds + row).to(tl.int64)
        step = tl.load(Steps + row).to(tl.int64)
        h = _mix32((seed & 0xFFFFFFFF).to(tl.uint32))
        h = _mix32(h ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
        h = _mix32(h + (step & 0x7FFFFFFF).to(tl.uint32) * 0x9E3779B1)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, V)
    offs = tl.arange(0, BLOCK)
    best_idx = tl.zeros([BLOCK], dtype=tl.int32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    out = row * tl.num_programs(1) + split
    best = tl.full([BLOCK], -1.0 if GUMBEL else float("-inf"), dtype=tl.float32)
    m_s = tl.full([], float("-inf"), dtype=tl.float32)  # one running max for the program
    if WHILE_LOOP:  # the 3.6 interpreter cannot `range` over a runtime scalar with NumPy >= 2.4
        start = lo
        while start < hi:
            best, best_idx, m_s, s = _chunk(row_ptr, start, V, temp, h, offs, best, best_idx, m_s, s, GUMBEL)
            start += BLOCK
    else:
        for start in range(lo, hi, BLOCK):
            best, best_idx, m_s, s = _chunk(row_ptr, start, V, temp, h, offs, best, best_idx, m_s, s, GUMBEL)
    top = tl.max(best, 0)
    tl.store(BestIdx + out, tl.min(tl.where(best == top, best_idx, 2147483647), 0))  # first index among maxima
    if GUMBEL:  # back to the log domain, comparable across splits: log(exp(x - m) / E) + m = x - log E
        top = tl.where(top > 0.0, tl.log(top) + m_s, float("-inf"))
    tl.store(Best + out, top)
    tl.store(M + out, m_s)
    tl.store(S + out, tl.sum(s, 0))


@jit
def _combine_kernel(Logits, stride_row, Temp, Best, BestIdx, M, S, Tok, Logp, SPLITS: tl.constexpr,
                    BLOCK_S: tl.constexpr):
    """Program (row): merge its SPLITS partials; ties between splits go to the lowest token id."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_S)
    mask = offs < SPLITS
    part = row * SPLITS + offs
    best = tl.load(Best + part, mask=mask, other=float("-inf"))
    best_idx = tl.load(BestIdx + part, mask=mask, other=2147483647)
    m = tl.load(M + part, mask=mask, other=float("-inf"))
    s = tl.load(S + part, mask=mask, other=0.0)
    top = tl.max(best, 0)
    tok = tl.min(tl.where(best == top, best_idx, 2147483647), 0)
    m_all = tl.max(m, 0)
    lse = m_all + tl.log(tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - m_all), 0.0), 0))
    x_tok = tl.load(Logits + row.to(tl.int64) * stride_row + tok).to(tl.float32) / tl.load(Temp).to(tl.float32)
    tl.store(Tok + row, tok.to(tl.int64))
    tl.store(Logp + row, x_tok - lse)


def auto_splits(V: int) -> int:
    """Programs per row from the vocab size alone (a CUDA graph replays a fixed grid): ~V / SPLIT_V, none empty."""
    return max(1, -(-V // SPLIT_V))


def fused_sample(logits_NV: torch.Tensor, mode: str, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, seeds_N: torch.Tensor, steps_N: torch.Tensor, *,
                 num_splits: int | None = None, block: int | None = None, warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampling.sample` for the `greedy` and `sample` modes, in two kernels (`sampling.kernel_sample` routes
    `filtered` to torch). `num_splits` (programs per row) defaults to `auto_splits(V)`; splits beyond the vocab
    stay empty."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"fused_sample mode={mode!r}: the kernel draws {KERNEL_MODES}; top-k/top-p ('filtered') "
                         "goes through sampling.sample (sampling.kernel_sample routes it)")
    logits = logits_NV if logits_NV.stride(-1) == 1 else logits_NV.contiguous()
    N, V = logits.shape
    splits = auto_splits(V) if num_splits is None else num_splits
    block = BLOCK_V if block is None else block
    chunk = -(-V // (splits * block)) * block  # whole BLOCK_V chunks, so no chunk straddles two splits
    dev = logits.device
    tok = torch.empty(N, dtype=torch.long, device=dev)
    logp = torch.empty(N, dtype=torch.float32, device=dev)
    part = torch.empty(3, N, splits, dtype=torch.float32, device=dev)  # best noisy score, max, sum of exp
    part_idx = torch.empty(N, splits, dtype=torch.int32, device=dev)
    if N:
        _partial_kernel[(N, splits)](logits, logits.stride(0), V, chunk, temperature, seeds_N, steps_N, part[0],
                                     part_idx, part[1], part[2], GUMBEL=mode == "sample", BLOCK=block,
                                     WHILE_LOOP=INTERPRETED, num_warps=WARPS if warps is None else warps)
        _combine_kernel[(N,)](logits, logits.stride(0), temperature, part[0], part_idx, part[1], part[2], tok,
                              logp, SPLITS=splits, BLOCK_S=max(32, triton.next_power_of_2(splits)), num_warps=1)
    return tok, logp
