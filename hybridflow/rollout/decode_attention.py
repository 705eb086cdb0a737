"""Decode attention over a per-row contiguous KV range: a Triton kernel plus a pure-torch reference/fallback.

One decode step attends each row's single query token (its G = H / Hkv query heads per kv head) to the row's valid
cache columns, which form one contiguous range [start, end) (left-padded prompt, then generated tokens).
SDPA with an additive [b, 1, 1, kv_len] mask reads every column up to kv_len and cannot skip the padding; this
kernel reads only [start, end) and loads each K/V tile once for all G query heads of its kv head.

Kernel (`_decode_kernel`): one program per (row, kv head, split). It walks its columns in BLOCK_N chunks with an
online softmax in fp32 (exp2 with the scale folded in), both products as `tl.dot` with the G query heads padded
to BLOCK_G >= 16 rows (tensor-core minimum; pad rows are zero and never stored). With one split (the default
whenever b * Hkv already fills the GPU) it writes the normalised output directly. With `num_splits` > 1
(split-K, picked automatically only when b * Hkv is small and the cache is long) each split covers an equal
BLOCK_N-aligned share of [start, end) and writes its normalised partial output and log2-sum-exp to fp32 scratch,
and `_combine_kernel` (one program per (row, kv head)) merges them.

Rows with an empty range (end <= start) produce zeros (SDPA would produce NaN); the reference does the same.
No host syncs, no data-dependent allocation: usable inside CUDA-graph capture once the kernels are compiled
(run it once eagerly first; Triton JIT-compiles per (dtype, G, D, BLOCK_N, splits) on the first call).

Interpreter (TRITON_INTERPRET=1, CPU tensors): triton fixes interpreted-vs-compiled for its own `tl.*` helpers
when triton is first imported, so the kernels here follow triton's import-time mode (`_INTERPRETED`), not the
current environment. In that mode the column loop is a `while` (the 3.6 interpreter's `range` over loaded
scalars fails with NumPy >= 2.4); compiled kernels use a `for` loop so the software pipeliner applies.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

__all__ = ["decode_attention", "decode_attention_ref", "triton_available"]

from hybridflow.utils.triton_util import INTERPRETED as _INTERPRETED
from hybridflow.utils.triton_util import jit as _jit
from hybridflow.utils.triton_util import tl, triton, triton_available

if triton is not None:
    from hybridflow.rollout.kv_store_kernel import check_rope_rows, rope_offsets, rope_rows

# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------


@_jit
def _attn_tile(q, k_base, v_base, n0, hi, m_i, l_i, acc, scale_log2, sk_t, sk_d, sv_t, sv_d,
               offs_n, offs_d, mask_d, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr):
    """One BLOCK_N chunk of columns [n0, min(n0 + BLOCK_N, hi)) folded into the online softmax state."""
    cols = n0 + offs_n
    mask_n = cols < hi
    k = tl.load(k_base + cols[None, :] * sk_t + offs_d[:, None] * sk_d,
                mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
    s = tl.dot(q, k, input_precision=DOT_PREC) * scale_log2  # [BLOCK_G, BLOCK_N], log2 domain
    s = tl.where(mask_n[None, :], s, float("-inf"))
    # The chunk holds >= 1 valid column, so m_new is finite and no NaN can arise.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + cols[:, None] * sv_t + offs_d[None, :] * sv_d,
                mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@_jit
def _decode_kernel(
    Q, K, V, Start, End, Rows, Out, MidO, MidLse, Cos, Sin,
    scale_log2,
    sq_b, sq_h, sq_g, sq_d, sc_b, sc_d, ss_b, ss_d,
    sk_b, sk_h, sk_t, sk_d,
    sv_b, sv_h, sv_t, sv_d,
    so_b, so_h, so_g, so_d,
    NUM_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr, DOT_PREC: tl.constexpr, WHILE_LOOP: tl.constexpr, HAS_ROWS: tl.constexpr,
    HAS_ROPE: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    n_heads = tl.num_programs(1)
    row64 = row.to(tl.int64)
    if HAS_ROWS:  # query row -> cache row (a multi-turn extension: several query tokens of one slot)
        crow64 = tl.load(Rows + row).to(tl.int64)
    else:
        crow64 = row64

    start = tl.load(Start + row).to(tl.int32)
    end = tl.load(End + row).to(tl.int32)
    if SPLITS > 1:
        n = tl.maximum(end - start, 0)
        chunk = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N) * BLOCK_N
        lo = start + split * chunk
        hi = tl.minimum(lo + chunk, end)
    else:
        lo = start
        hi = end

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < NUM_G
    mask_d = offs_d < HEAD_DIM

    q_ptrs = Q + row64 * sq_b + head * sq_h + offs_g[:, None] * sq_g + offs_d[None, :] * sq_d
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    if HAS_ROPE:  # q = q * cos + rotate_half(q) * sin (fp32, one rounding), cos/sin of this row
        qr_ptrs = (Q + row64 * sq_b + head * sq_h + offs_g[:, None] * sq_g
                   + rope_offsets(offs_d, HEAD_DIM)[None, :] * sq_d)
        qr = tl.load(qr_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)
        c = tl.load(Cos + row64 * sc_b + offs_d * sc_d, mask=mask_d, other=0.0)
        s = tl.load(Sin + row64 * ss_b + offs_d * ss_d, mask=mask_d, other=0.0)
        q = rope_rows(q, qr, c[None, :], s[None, :], offs_d[None, :], HEAD_DIM)
    q = q.to(K.dtype.element_ty)
    k_base = K + crow64 * sk_b + head * sk_h
    v_base = V + crow64 * sv_b + head * sv_h

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    if WHILE_LOOP:  # interpreter only
        n0 = lo
        while n0 < hi:
            m_i, l_i, acc = _attn_tile(q, k_base, v_base, n0, hi, m_i, l_i, acc, scale_log2, sk_t, sk_d, sv_t,
                                       sv_d, offs_n, offs_d, mask_d, BLOCK_N, DOT_PREC)
            n0 += BLOCK_N
    else:
        for n0 in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _attn_tile(q, k_base, v_base, n0, hi, m_i, l_i, acc, scale_log2, sk_t, sk_d, sv_t,
                                       sv_d, offs_n, offs_d, mask_d, BLOCK_N, DOT_PREC)

    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    o = acc / l_safe[:, None]
    mask_o = mask_g[:, None] & mask_d[None, :]
    if SPLITS == 1:
        o_ptrs = Out + row64 * so_b + head * so_h + offs_g[:, None] * so_g + offs_d[None, :] * so_d
        tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=mask_o)
    else:
        # Scratch layout: MidO [b, Hkv, SPLITS, G, D], MidLse [b, Hkv, SPLITS, G], contiguous fp32.
        slot = (row64 * n_heads + head) * SPLITS + split
        tl.store(MidO + slot * (NUM_G * HEAD_DIM) + offs_g[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask_o)
        lse = tl.where(has, m_i + tl.log2(l_safe), -1.0e30)  # empty split: finite sentinel, weight ~0
        tl.store(MidLse + slot * NUM_G + offs_g, lse, mask=mask_g)


@_jit
def _combine_kernel(
    MidO, MidLse, Out,
    so_b, so_h, so_g, so_d,
    NUM_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    n_heads = tl.num_programs(1)
    row64 = row.to(tl.int64)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < NUM_G
    mask_o = mask_g[:, None] & (offs_d[None, :] < HEAD_DIM)

    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    den = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for s in range(SPLITS):
        slot = (row64 * n_heads + head) * SPLITS + s
        lse = tl.load(MidLse + slot * NUM_G + offs_g, mask=mask_g, other=-1.0e30)
        o_s = tl.load(MidO + slot * (NUM_G * HEAD_DIM) + offs_g[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=mask_o, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + w[:, None] * o_s
        den = den * alpha + w
        m = m_new
    o = acc / den[:, None]
    o_ptrs = Out + row64 * so_b + head * so_h + offs_g[:, None] * so_g + offs_d[None, :] * so_d
    tl.store(o_ptrs, o.to(Out.dtype.element_ty), mask=mask_o)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # interpreter: pretend H100/H200 so the heuristic behaves as on the GPU


def _auto_splits(b: int, hkv: int, t: int, device: torch.device, block_n: int) -> int:
    """Static (shape-only) split-K choice: split only when b * Hkv programs leave most SMs idle, and keep
    >= 4 BLOCK_N chunks of the cache length per split."""
    programs = b * hkv
    target = 2 * _sm_count(device)
    if programs >= target:
        return 1
    by_len = max(1, t // (4 * block_n))
    return max(1, min(16, -(-target // programs), by_len))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor,
                     end: torch.Tensor, scale: float | None = None, *, rows: torch.Tensor | None = None,
                     num_splits: int | None = None, block_n: int = 64, num_warps: int = 4,
                     num_stages: int = 2, cos: torch.Tensor | None = None,
                     sin: torch.Tensor | None = None) -> torch.Tensor:
    """o[i, h, g] = softmax(q[i, h, g] . K[r, h, start[i]:end[i]] * scale) @ V[r, h, start[i]:end[i]], r = rows[i]
    (default r = i).

    q [b, Hkv, G, D]; k_cache / v_cache [S, Hkv, T, D] (S >= b without `rows`: only rows < b are read; any strides,
    e.g. a column slice of the per-layer cache); start / end int32 or int64 [b] on q's device, 0 <= start, end <= T;
    `rows` [b] cache rows in [0, S) — a multi-turn extension passes each new token's slot, its range ending at the
    token's own column (causal within the extension, as the token's K/V were written first).
    Returns o [b, Hkv, G, D] in q's dtype (contiguous); softmax in fp32; scale defaults to 1/sqrt(D).
    `num_splits` None picks split-K from shapes only (see `_auto_splits`); 1 disables it. `block_n`
    (columns per chunk, power of 2 >= 16), `num_warps` and `num_stages` are launch knobs for tuning.
    With cos/sin [b, D] (q's dtype) q gets RoPE first (`rope_rows`: fp32, one rounding, as compiled
    `forward.apply_rope`).
    """
    if triton is None:
        raise RuntimeError("triton is not installed; use decode_attention_ref")
    b, hkv, g, d = q.shape
    check_rope_rows(cos, sin, b, d, q.dtype, "q")
    if (rows is None and k_cache.shape[0] < b) or k_cache.shape[1] != hkv or k_cache.shape[3] != d:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} does not match q {tuple(q.shape)}")
    if rows is not None and rows.shape != (b,):
        raise ValueError(f"rows must be [b={b}], got {tuple(rows.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    if start.shape != (b,) or end.shape != (b,):
        raise ValueError(f"start/end must be [b={b}], got {tuple(start.shape)} / {tuple(end.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache dtypes differ")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    splits = _auto_splits(b, hkv, k_cache.shape[2], q.device, block_n) if num_splits is None else num_splits

    out = torch.empty((b, hkv, g, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    block_g = max(16, triton.next_power_of_2(g))
    block_d = max(16, triton.next_power_of_2(d))
    prec = "ieee" if k_cache.dtype == torch.float32 else "tf32"  # fp32 caches: no TF32 rounding
    meta = dict(NUM_G=g, HEAD_DIM=d, BLOCK_G=block_g, BLOCK_D=block_d)
    if splits > 1:
        mid_o = torch.empty((b, hkv, splits, g, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((b, hkv, splits, g), dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_lse = out  # unused (SPLITS == 1 branch is compiled out)
    _decode_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, start, end, start if rows is None else rows, out, mid_o, mid_lse,
        *((cos, sin) if cos is not None else (q, q)),  # unused without RoPE (compiled out)
        scale * math.log2(math.e),
        *q.stride(), *((*cos.stride(), *sin.stride()) if cos is not None else (0, 0, 0, 0)),
        *k_cache.stride(), *v_cache.stride(), *out.stride(),
        BLOCK_N=block_n, SPLITS=splits, DOT_PREC=prec, WHILE_LOOP=_INTERPRETED, HAS_ROWS=rows is not None,
        HAS_ROPE=cos is not None,
        num_warps=num_warps, num_stages=num_stages, **meta,
    )
    if splits > 1:
        _combine_kernel[(b, hkv)](mid_o, mid_lse, out, *out.stride(), SPLITS=splits, num_warps=4, **meta)
    return out


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor,
                         end: torch.Tensor, scale: float | None = None, *, rows: torch.Tensor | None = None,
                         cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch reference / fallback: SDPA over all T columns of rows [:b] with the [start, end) mask.

    Same contract as `decode_attention` (rows with an empty range give zeros). Computes in q's dtype (SDPA
    accumulates the softmax in fp32 for half types); reads all T columns, so slice the cache to the needed
    length first where it matters.
    """
    b = q.shape[0]
    if cos is not None:
        from hybridflow.rollout.forward import apply_rope

        q = apply_rope(q, cos[:, None, None], sin[:, None, None])
    k, v = (k_cache[:b], v_cache[:b]) if rows is None else (k_cache[rows], v_cache[rows])
    cols = torch.arange(k.shape[2], device=q.device)
    valid = (cols >= start[:, None]) & (cols < end[:, None])  # [b, T]
    mask = torch.zeros(valid.shape, dtype=q.dtype, device=q.device).masked_fill_(~valid, float("-inf"))
    o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask[:, None, None, :],
                                       scale=scale)
    return torch.where(valid.any(1)[:, None, None, None], o, torch.zeros((), dtype=o.dtype, device=o.device))
