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

from hybridflow.rollout.triton_util import jit, tl, triton


@jit
def _kv_store_kernel(KCache, VCache, NewK, NewV, Cidx, Rows,
                     sk_s, sk_h, sk_t, sk_d, sv_s, sv_h, sv_t, sv_d,
                     snk_b, snk_h, snk_d, snv_b, snv_h, snv_d,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ROWS: tl.constexpr):
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
    tl.store(KCache + slot * sk_s + head * sk_h + col * sk_t + offs * sk_d, k, mask=mask)
    tl.store(VCache + slot * sv_s + head * sv_h + col * sv_t + offs * sv_d, v, mask=mask)


def store_kv(k_cache_SHTD: torch.Tensor, v_cache_SHTD: torch.Tensor, k_bHD: torch.Tensor, v_bHD: torch.Tensor,
             cidx_b: torch.Tensor, rows_b: torch.Tensor | None = None) -> None:
    """k_cache[r, :, cidx[i]] = k[i] and v_cache[r, :, cidx[i]] = v[i] for i < b with r = rows[i] (default i), in
    one launch (any strides)."""
    b, hkv, d = k_bHD.shape
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
    _kv_store_kernel[(b, hkv)](k_cache_SHTD, v_cache_SHTD, k_bHD, v_bHD, cidx_b,
                               cidx_b if rows_b is None else rows_b, *k_cache_SHTD.stride(),
                               *v_cache_SHTD.stride(), *k_bHD.stride(), *v_bHD.stride(), HEAD_DIM=d,
                               BLOCK_D=triton.next_power_of_2(d), HAS_ROWS=rows_b is not None, num_warps=1)


def store_kv_ref(k_cache_SHTD: torch.Tensor, v_cache_SHTD: torch.Tensor, k_bHD: torch.Tensor, v_bHD: torch.Tensor,
                 cidx_b: torch.Tensor, rows_b: torch.Tensor | None = None) -> None:
    """`store_kv` in torch (two `index_put`s): the CPU path and the kernel's reference."""
    rows = torch.arange(k_bHD.shape[0], device=k_bHD.device) if rows_b is None else rows_b
    k_cache_SHTD[rows, :, cidx_b] = k_bHD
    v_cache_SHTD[rows, :, cidx_b] = v_bHD
