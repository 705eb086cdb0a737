"""The decode sampler as one Triton kernel: Gumbel-max (or argmax) and the log-prob in a single pass over the vocab.

Same contract and noise as `sampling.sample` for the `sample` and `greedy` modes: token = argmax(logits / T + G),
G = -log(-log(u)), u from the 32-bit counter hash of (seed, step, token id); log-prob = logits[tok] / T -
logsumexp(logits / T). One program per row walks the vocab in BLOCK_V chunks keeping the running max of the noisy
scores with its index and an online logsumexp, so the [rows, vocab] noise and fp32 copies never exist (the eager
torch version runs ~15 kernels over 256 × 151,936 int64/fp32 elements per step; Inductor failed to compile it on
torch 2.11). The hash runs in uint32, whose wrapping multiply equals the int64-and-mask arithmetic of
`sampling._mix32`, so the noise is bit-identical; `log` may differ from torch's in the last ulp, so a near-tie can
resolve differently between this kernel and the torch path (each is deterministic on its own). `filtered` (top-k /
top-p) needs a sort and stays in torch.
"""

from __future__ import annotations

import torch

from hybridflow.rollout import sampling
from hybridflow.rollout.triton_util import INTERPRETED, jit, tl, triton_available

BLOCK_V = 2048


@jit
def _mix32(x):
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@jit
def _chunk(row_ptr, start, V, temp, h, offs, best, best_idx, m, s, GUMBEL: tl.constexpr):
    """Fold vocab entries [start, start + BLOCK) into the running argmax and logsumexp state (per lane)."""
    idx = start + offs
    mask = idx < V
    x = tl.load(row_ptr + idx, mask=mask, other=float("-inf")).to(tl.float32) / temp
    m_new = tl.maximum(m, x)
    alpha = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
    s = s * alpha + tl.where(mask & (x > float("-inf")), tl.exp(x - m_new), 0.0)
    if GUMBEL:
        e = _mix32(h + idx.to(tl.uint32) * 0x85EBCA6B)
        u = ((e >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        y = x - tl.log(-tl.log(u))
    else:
        y = x
    y = tl.where(mask, y, float("-inf"))
    better = y > best  # strict: the earliest chunk wins ties, as torch.argmax's first index
    return tl.where(better, y, best), tl.where(better, idx, best_idx), m_new, s


@jit
def _sample_kernel(Logits, stride_row, V, Temp, Seeds, Steps, Tok, Logp, GUMBEL: tl.constexpr,
                   BLOCK: tl.constexpr, WHILE_LOOP: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = Logits + row.to(tl.int64) * stride_row
    temp = tl.load(Temp).to(tl.float32)
    h = tl.zeros([], dtype=tl.uint32)
    if GUMBEL:
        seed = tl.load(Seeds + row).to(tl.int64)
        step = tl.load(Steps + row).to(tl.int64)
        h = _mix32((seed & 0xFFFFFFFF).to(tl.uint32))
        h = _mix32(h ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
        h = _mix32(h + (step & 0x7FFFFFFF).to(tl.uint32) * 0x9E3779B1)
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)  # per lane: best noisy score and its token id
    best_idx = tl.zeros([BLOCK], dtype=tl.int32)
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)  # per lane: online logsumexp state
    s = tl.zeros([BLOCK], dtype=tl.float32)
    if WHILE_LOOP:  # the 3.6 interpreter cannot `range` over a runtime scalar with NumPy >= 2.4
        start = 0
        while start < V:
            best, best_idx, m, s = _chunk(row_ptr, start, V, temp, h, offs, best, best_idx, m, s, GUMBEL)
            start += BLOCK
    else:
        for start in range(0, V, BLOCK):
            best, best_idx, m, s = _chunk(row_ptr, start, V, temp, h, offs, best, best_idx, m, s, GUMBEL)
    top = tl.max(best, 0)
    tok = tl.min(tl.where(best == top, best_idx, 2147483647), 0)  # first index among the lanes' maxima
    m_all = tl.max(m, 0)
    lse = m_all + tl.log(tl.sum(s * tl.exp(m - m_all), 0))
    x_tok = tl.load(row_ptr + tok).to(tl.float32) / temp
    tl.store(Tok + row, tok.to(tl.int64))
    tl.store(Logp + row, x_tok - lse)


def fused_sample(logits_NV: torch.Tensor, mode: str, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, seeds_N: torch.Tensor, steps_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampling.sample` with `greedy` and `sample` in one kernel; `filtered` goes to the torch version."""
    if mode == "filtered" or not triton_available(logits_NV.device):
        return sampling.sample(logits_NV, mode, temperature, top_k, top_p, seeds_N, steps_N)
    if mode not in sampling.MODES:
        raise ValueError(f"sampling mode={mode!r}; choose one of {sampling.MODES}")
    logits = logits_NV if logits_NV.stride(-1) == 1 else logits_NV.contiguous()
    N, V = logits.shape
    tok = torch.empty(N, dtype=torch.long, device=logits.device)
    logp = torch.empty(N, dtype=torch.float32, device=logits.device)
    if N:
        _sample_kernel[(N,)](logits, logits.stride(0), V, temperature, seeds_N, steps_N, tok, logp,
                             GUMBEL=mode == "sample", BLOCK=BLOCK_V, WHILE_LOOP=INTERPRETED, num_warps=8)
    return tok, logp
