"""A decode step's K/V cache write as one Triton kernel: cache[i, :, cidx[i]] = new[i] for K and V of every row
(or cache[rows[i], :, cidx[i]] with a row map: a multi-turn extension writes several tokens of one slot).

The torch form (`kc[rows, :, cidx] = k; vc[rows, :, cidx] = v`) is two `index_put` launches per layer per step
(~0.2 ms of every step of a 24-layer model on an H200); this is one launch of b × Hkv programs, each copying one
head's D values of K and of V. Shapes only decide the grid, so it captures in a CUDA graph. The caller guarantees
0 <= cidx < T (the runner clamps it); rows are distinct slots, or (with a row map) the (row, column) pairs are
distinct except for exact duplicates writing the same values (the extension's padding repeats its last token).

Legend: S slots, b rows (b <= S, row i is slot i), Hkv kv heads, T cache columns, D head dim.
"""

from __future__ import annotations

import torch

from hybridflow.utils.triton_util import jit, tl, triton


@jit
def rope_rows(x, xr, c, s, offs, HEAD_DIM: tl.constexpr):
    """RoPE of loaded head vectors: x * cos + rotate_half(x) * sin computed in fp32 and rounded once to x's dtype,
    as the compiled (Inductor) `forward.apply_rope` does; eager torch in bf16 rounds after each op instead, so the
    two differ by at most a rounding step (tests bound it). xr is x loaded at the rotated offsets
    (`rope_offsets`); c, s the row's cos/sin, broadcastable to x."""
    xr = xr.to(tl.float32)
    xr = tl.where(offs < HEAD_DIM // 2, -xr, xr)
    return (x.to(tl.float32) * c.to(tl.float32) + xr * s.to(tl.float32)).to(x.dtype)


def check_rope_rows(cos: torch.Tensor | None, sin: torch.Tensor | None, b: int, d: int, dtype: torch.dtype,
                    what: str) -> None:
    """The kernels' RoPE inputs: both or neither, each [b, D] of the rotated tensor's dtype, D even."""
    if (cos is None) != (sin is None) or (cos is not None and (cos.shape != (b, d) or sin.shape != (b, d)
                                                               or cos.dtype != dtype or d % 2)):
        raise ValueError(f"cos/sin must both be [b={b}, D={d}] of {what}'s dtype with D even")


@jit
def rope_offsets(offs, HEAD_DIM: tl.constexpr):
    """rotate_half's source index: d + D/2 for the first half (negated), d - D/2 for the second."""
    return tl.where(offs < HEAD_DIM // 2, offs + HEAD_DIM // 2, offs - HEAD_DIM // 2)


@jit
def _kv_store_kernel(KCache, VCache, NewK, NewV, Cidx, Rows, Cos, Sin,
                     sk_s, sk_h, sk_t, sk_d, sv_s, sv_h, sv_t, sv_d,
                     snk_b, snk_h, snk_d, snv_b, snv_h, snv_d, sc_b, sc_d, ss_b, ss_d,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ROWS: tl.constexpr,
                     HAS_ROPE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # S × Hkv × T × D can pass 2**31 elements
    head = tl.program_id(1)
    col = tl.load(Cidx + row).to(tl.int64)
    if HAS_ROWS:
        slot = tl.load(Rows + row).to(tl.int64)
    else:
        slot = row
    offs = tl.arange(0, BLOCK_D)
    mask = offs < HEAD_DIM
    k = tl.load(NewK + row * snk_b + head * snk_h + offs * snk_d, mask=mask)
    v = tl.load(NewV + row * snv_b + head * snv_h + offs * snv_d, mask=mask)
    if HAS_ROPE:  # k = k * cos + rotate_half(k) * sin (fp32, one rounding), cos/sin of this row
        kr = tl.load(NewK + row * snk_b + head * snk_h + rope_offsets(offs, HEAD_DIM) * snk_d, mask=mask)
        c = tl.load(Cos + row * sc_b + offs * sc_d, mask=mask)
        s = tl.load(Sin + row * ss_b + offs * ss_d, mask=mask)
        k = rope_rows(k, kr, c, s, offs, HEAD_DIM)
    tl.store(KCache + slot * sk_s + head * sk_h + col * sk_t + offs * sk_d, k, mask=mask)
    tl.store(VCache + slot * sv_s + head * sv_h + col * sv_t + offs * sv_d, v, mask=mask)


def store_kv(k_cache_SHTD: torch.Tensor, v_cache_SHTD: torch.Tensor, k_bHD: torch.Tensor, v_bHD: torch.Tensor,
             cidx_b: torch.Tensor, rows_b: torch.Tensor | None = None, *, cos: torch.Tensor | None = None,
             sin: torch.Tensor | None = None) -> None:
    """k_cache[r, :, cidx[i]] = k[i] and v_cache[r, :, cidx[i]] = v[i] for i < b with r = rows[i] (default i), in
    one launch (any strides). With cos/sin [b, D] (k's dtype) k[i] is stored with RoPE applied (`rope_rows`: fp32,
    one rounding)."""
    b, hkv, d = k_bHD.shape
    check_rope_rows(cos, sin, b, d, k_bHD.dtype, "k")
    if v_bHD.shape != k_bHD.shape or cidx_b.shape != (b,) or (rows_b is not None and rows_b.shape != (b,)):
        raise ValueError(f"k {tuple(k_bHD.shape)}, v {tuple(v_bHD.shape)}, cidx {tuple(cidx_b.shape)} and rows "
                         f"{None if rows_b is None else tuple(rows_b.shape)} must be [b, Hkv, D], [b, Hkv, D], [b], [b]")
    for cache, new in ((k_cache_SHTD, k_bHD), (v_cache_SHTD, v_bHD)):
        if cache.dim() != 4 or (rows_b is None and cache.shape[0] < b) or cache.shape[1] != hkv or cache.shape[3] != d:
            raise ValueError(f"cache {tuple(cache.shape)} does not hold rows of {tuple(new.shape)}")
        if cache.dtype != new.dtype:  # as index_put: no silent cast
            raise ValueError(f"cache dtype {cache.dtype} != new K/V dtype {new.dtype}")
    if b == 0:
        return
    rope = (cos, sin) if cos is not None else (k_bHD, k_bHD)  # unused without RoPE (compiled out)
    _kv_store_kernel[(b, hkv)](k_cache_SHTD, v_cache_SHTD, k_bHD, v_bHD, cidx_b,
                               cidx_b if rows_b is None else rows_b, *rope, *k_cache_SHTD.stride(),
                               *v_cache_SHTD.stride(), *k_bHD.stride(), *v_bHD.stride(),
                               *rope[0].stride()[-2:], *rope[1].stride()[-2:], HEAD_DIM=d,
                               BLOCK_D=triton.next_power_of_2(d), HAS_ROWS=rows_b is not None,
                               HAS_ROPE=cos is not None, num_warps=1)


def store_kv_ref(k_cache_SHTD: torch.Tensor, v_cache_SHTD: torch.Tensor, k_bHD: torch.Tensor, v_bHD: torch.Tensor,
                 cidx_b: torch.Tensor, rows_b: torch.Tensor | None = None, *, cos: torch.Tensor | None = None,
                 sin: torch.Tensor | None = None) -> None:
    """`store_kv` in torch (two `index_put`s): the CPU path and the kernel's reference."""
    if cos is not None:
        from hybridflow.rollout.forward import apply_rope

        k_bHD = apply_rope(k_bHD, cos[:, None], sin[:, None])
    rows = torch.arange(k_bHD.shape[0], device=k_bHD.device) if rows_b is None else rows_b
    k_cache_SHTD[rows, :, cidx_b] = k_bHD
    v_cache_SHTD[rows, :, cidx_b] = v_bHD
