"""Triton forms of the batch-invariant ops (engine/invariant.py) for CUDA: one launch each instead of a torch loop of
row tiles and key blocks.

Decision: a row's arithmetic is fixed by the weight's shape alone. The GEMM uses one tile configuration per (N, K)
— never chosen by M, no split-K, the K loop in one order, fp32 accumulation — so a row meets the same instructions
whether it is alone or one of thousands; RMSNorm is one program per row; attention is one program per (query, kv
head), walking its keys in KEY_BLOCK blocks from the sequence's first key with an fp32 online softmax (16-bit q/k/v
meet the tensor cores with fp32 accumulation, the probabilities rounded to the value dtype for p·v, as flash
attention does; fp32 inputs take exact fp32 dots), the same code for the trainer's packed queries and the rollout's prefill, decode and extension over the KV cache. Values
are close to, not equal to, the torch forms (other reduction orders): both engines use the same form on a device.
An output column's arithmetic is the K loop alone, the same in every N tile: a fused [a; b] matrix run with the
parts' tile width (`shared_block_n`) gives each part's columns the bits of the part's own GEMM.

Legend: M rows, N out features, K in features, H heads, Hkv kv heads, G = H / Hkv, D head dim, S cache rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridflow.utils.triton_util import jit, tl, triton

BLOCK_M, BLOCK_K = 64, 64


def _block_n(n: int) -> int:
    # small N (the projections of a small model): narrower tiles give a decode step more programs
    return 64 if n <= 4096 else 128


def shared_block_n(sizes: Sequence[int]) -> int | None:
    """The tile width every part of these output sizes runs with in its own `linear` call, when they share one;
    None when they differ (no single launch of the fused matrix reproduces all of them)."""
    widths = {_block_n(n) for n in sizes}
    return widths.pop() if len(widths) == 1 else None


@jit(do_not_specialize=["M"])
def _linear_kernel(X, W, B, Y, M, N, K, sxm, sxk, swn, swk, sym, syn, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        a = tl.load(X + rm[:, None] * sxm + kk[None, :] * sxk, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(W + rn[None, :] * swn + kk[:, None] * swk, mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rm[:, None] * sym + rn[None, :] * syn, acc.to(Y.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           block_n: int | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): x [..., K], weight [N, K] of x's dtype; fp32 accumulation, bias added in fp32.
    `block_n`: the tile width over N (default: chosen by N), e.g. a fused matrix's parts' `shared_block_n`."""
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"batch-invariant linear needs one dtype: x {x.dtype}, weight {weight.dtype}, "
                         f"bias {None if bias is None else bias.dtype}")
    if block_n is not None and (block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"block_n={block_n} must be a power of two >= 16 (tl.dot's smallest tile)")
    x_MK = x.reshape(-1, x.shape[-1])
    (M, K), N = x_MK.shape, weight.shape[0]
    y_MN = torch.empty(M, N, dtype=x.dtype, device=x.device)
    bn = _block_n(N) if block_n is None else block_n
    if M:
        _linear_kernel[(triton.cdiv(M, BLOCK_M), triton.cdiv(N, bn))](
            x_MK, weight, weight if bias is None else bias, y_MN, M, N, K, *x_MK.stride(), *weight.stride(),
            *y_MN.stride(), HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=BLOCK_K,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4, num_stages=3)  # precision: fp32 operands only
    return y_MN.view(*x.shape[:-1], N)


@jit(do_not_specialize=["M"])
def _rms_norm_kernel(X, W, Y, M, K, sx, sy, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(X + row * sx + offs, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
    xn = (x * r).to(X.dtype.element_ty).to(tl.float32)  # HF: normalise in fp32, round to the input dtype, scale
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * sy + offs, (w * xn).to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """w * (x * rsqrt(mean(x²) + eps)).to(x.dtype) over the last dim, fp32 statistics; torch's result dtype."""
    x_MK = x.reshape(-1, x.shape[-1]).contiguous()
    M, K = x_MK.shape
    y_MK = torch.empty(M, K, dtype=torch.promote_types(w.dtype, x.dtype), device=x.device)
    if M:
        _rms_norm_kernel[(M,)](x_MK, w.contiguous(), y_MK, M, K, x_MK.stride(0), y_MK.stride(0), eps,
                               BLOCK=triton.next_power_of_2(K), num_warps=4)
    return y_MK.view(x.shape)


@jit
def _attention_kernel(Q, Kc, Vc, Out, Rows, First, Last, scale, sqn, sqh, sqd, sks, skh, skc, skd,
                      svs, svh, svc, svd, son, soh, sod, G: tl.constexpr, D: tl.constexpr, GP: tl.constexpr,
                      DP: tl.constexpr, KEY_BLOCK: tl.constexpr, BP: tl.constexpr, LOWP: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    qmask = (g[:, None] < G) & (d[None, :] < D)
    q = tl.load(Q + i * sqn + (hk * G + g[:, None]) * sqh + d[None, :] * sqd, mask=qmask, other=0.0)
    if not LOWP:
        q = q.to(tl.float32)
    row = tl.load(Rows + i).to(tl.int64)
    first = tl.load(First + i).to(tl.int64)
    last = tl.load(Last + i).to(tl.int64)
    kbase = Kc + row * sks + hk * skh
    vbase = Vc + row * svs + hk * svh
    offs = tl.arange(0, BP)  # BP >= KEY_BLOCK columns (tl.dot needs 16): the extra ones are masked out
    m = tl.full((GP,), float("-inf"), dtype=tl.float32)
    l_ = tl.zeros((GP,), dtype=tl.float32)
    acc = tl.zeros((GP, DP), dtype=tl.float32)
    # blocks past `last` would be masked whole and change no bit: each query stops at its own last block
    for j in range(0, (last - first) // KEY_BLOCK + 1):
        cols = first + j * KEY_BLOCK + offs
        ok = (offs < KEY_BLOCK) & (cols <= last)
        kvmask = ok[:, None] & (d[None, :] < D)
        k = tl.load(kbase + cols[:, None] * skc + d[None, :] * skd, mask=kvmask, other=0.0)
        v = tl.load(vbase + cols[:, None] * svc + d[None, :] * svd, mask=kvmask, other=0.0)
        if LOWP:  # 16-bit operands on the tensor cores, fp32 accumulation (as flash attention)
            s = tl.dot(q, tl.trans(k)) * scale
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_ = l_ * alpha + tl.sum(p, axis=1)
        if LOWP:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        m = m_new
    o = acc / l_[:, None]
    tl.store(Out + i * son + (hk * G + g[:, None]) * soh + d[None, :] * sod, o.to(Out.dtype.element_ty), mask=qmask)


def attention(q_NHD: torch.Tensor, k_SHCD: torch.Tensor, v_SHCD: torch.Tensor, rows_N: torch.Tensor,
              first_N: torch.Tensor, last_N: torch.Tensor, scale: float, key_block: int) -> torch.Tensor:
    """o [N, H, D] (q's dtype): query i attends to k[rows[i], :, first[i] .. last[i]] (see invariant.attention)."""
    N, H, D = q_NHD.shape
    hkv = k_SHCD.shape[1]
    if key_block & (key_block - 1):
        raise ValueError(f"KEY_BLOCK={key_block} must be a power of two for the Triton attention")
    o = torch.empty(N, H, D, dtype=q_NHD.dtype, device=q_NHD.device)
    if N:
        _attention_kernel[(N, hkv)](
            q_NHD, k_SHCD, v_SHCD, o, rows_N, first_N, last_N, scale, *q_NHD.stride(), *k_SHCD.stride(),
            *v_SHCD.stride(), *o.stride(), G=H // hkv, D=D, GP=max(16, triton.next_power_of_2(H // hkv)),
            DP=max(16, triton.next_power_of_2(D)), KEY_BLOCK=key_block, BP=max(16, key_block),
            LOWP=q_NHD.dtype in (torch.bfloat16, torch.float16) and k_SHCD.dtype == v_SHCD.dtype == q_NHD.dtype,
            num_warps=4)
    return o


@jit(do_not_specialize=["M"])
def _logz_kernel(Z, Temp, Out, M, V, sz, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(Temp)
    offs = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    for v0 in range(0, V, BLOCK):  # online log-sum-exp over the row in fixed chunks
        z = tl.load(Z + row * sz + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32) / t
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    tl.store(Out + row, m + tl.log(s))


def logsumexp(logits_NV: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log Σ exp(logits / temperature) per row [N] fp32; `temperature` a 0-d fp32 device tensor."""
    logits_NV = logits_NV if logits_NV.stride(-1) == 1 else logits_NV.contiguous()
    N, V = logits_NV.shape
    out = torch.empty(N, dtype=torch.float32, device=logits_NV.device)
    if N:
        _logz_kernel[(N,)](logits_NV, temperature, out, N, V, logits_NV.stride(0), BLOCK=4096, num_warps=8)
    return out
