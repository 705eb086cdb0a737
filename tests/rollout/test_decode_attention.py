"""Triton decode attention vs the masked-SDPA reference.

With a GPU the compiled kernel is tested in-process (fp32 and bf16, plus CUDA-graph capture). Without one the
kernel runs under Triton's interpreter (fp32 CPU tensors; bf16 `tl.dot` is wrong in the 3.6 interpreter). The
interpreter must be on when triton is first imported (triton fixes its own tl.* helpers then), and torch >= 2.13
imports triton as soon as torch is imported, so setting TRITON_INTERPRET inside this module is too late: when this
process's triton is compiled-mode, the kernel tests are skipped here and `test_kernel_under_interpreter` reruns
this file in a subprocess with TRITON_INTERPRET=1 (`TRITON_INTERPRET=1 pytest <this file>` runs them directly).
"""

from __future__ import annotations

import math

import pytest
import torch
from rollout_helpers import CUDA, DEV, KERNEL_HERE, needs_kernel, rerun_under_triton_interpreter

pytest.importorskip("triton")
from hybridflow.rollout import decode_attention as da  # noqa: E402


def make(b, S, hkv, g, d, t, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv, g, d, generator=gen)
    k = torch.randn(S, hkv, t, d, generator=gen)
    v = torch.randn(S, hkv, t, d, generator=gen)
    return q.to(DEV, dtype), k.to(DEV, dtype), v.to(DEV, dtype)


def ranges(pairs, dtype=torch.int64):
    start = torch.tensor([p[0] for p in pairs], dtype=dtype, device=DEV)
    end = torch.tensor([p[1] for p in pairs], dtype=dtype, device=DEV)
    return start, end


def naive(q, k, v, start, end, scale=None):
    """Row-by-row softmax over the explicit column slice (checks the reference itself)."""
    b, hkv, g, d = q.shape
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(b, hkv, g, d, dtype=torch.float64)
    for i in range(b):
        s, e = int(start[i]), int(end[i])
        if e <= s:
            continue
        kk, vv = k[i, :, s:e].double(), v[i, :, s:e].double()  # [hkv, n, d]
        att = torch.softmax(q[i].double() @ kk.transpose(-1, -2) * scale, -1)  # [hkv, g, n]
        out[i] = att @ vv
    return out


# T = 70: not a multiple of BLOCK_N (64); rows: full, single column, ragged middle, single last column.
PAIRS = [(0, 70), (5, 6), (13, 61), (69, 70)]


@needs_kernel
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("g", [1, 6, 7, 8])
def test_kernel_matches_reference(g, d):
    q, k, v = make(4, 6, 2, g, d, 70, seed=g * d)
    start, end = ranges(PAIRS)
    o = da.decode_attention(q, k, v, start, end, num_splits=1)
    ref = da.decode_attention_ref(q, k, v, start, end)
    assert o.shape == q.shape and o.dtype == q.dtype
    torch.testing.assert_close(o, ref, atol=1e-4, rtol=1e-4)


@needs_kernel
@pytest.mark.parametrize("splits", [1, 3])
def test_row_map_reads_the_mapped_cache_rows(splits):
    """A multi-turn extension: 7 query tokens of 3 slots (in any order, one slot twice in a row), each with its own
    causal range end, read cache rows through `rows`; equal to the reference and to unmapped calls per token."""
    q, k, v = make(7, 4, 2, 6, 64, 70, seed=11 + splits)
    rows = torch.tensor([2, 2, 0, 3, 2, 0, 1], device=DEV)
    start, end = ranges([(5, 40), (5, 41), (0, 70), (13, 14), (5, 42), (0, 12), (69, 70)])
    o = da.decode_attention(q, k, v, start, end, rows=rows, num_splits=splits, block_n=16)
    ref = da.decode_attention_ref(q, k, v, start, end, rows=rows)
    torch.testing.assert_close(o, ref, atol=1e-4, rtol=1e-4)
    for i in range(7):
        r = int(rows[i])
        one = da.decode_attention_ref(q[i: i + 1], k[r: r + 1], v[r: r + 1], start[i: i + 1], end[i: i + 1])
        torch.testing.assert_close(o[i: i + 1], one, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="rows must be"):
        da.decode_attention(q, k, v, start, end, rows=rows[:3])


@needs_kernel
@pytest.mark.parametrize("splits,block_n", [(2, 64), (3, 16), (5, 32)])
def test_split_k_and_empty_rows(splits, block_n):
    """Split-K merge, including splits with no columns (short rows) and a row with an empty range (zeros)."""
    q, k, v = make(5, 5, 2, 7, 64, 90, seed=splits)
    start, end = ranges([(0, 90), (40, 41), (3, 50), (10, 10), (89, 90)], dtype=torch.int32)
    o = da.decode_attention(q, k, v, start, end, num_splits=splits, block_n=block_n)
    ref = da.decode_attention_ref(q, k, v, start, end)
    torch.testing.assert_close(o, ref, atol=1e-4, rtol=1e-4)
    assert torch.all(o[3] == 0)


@needs_kernel
def test_strided_inputs_and_scale():
    """q from a transpose, a column slice of a wider cache (T stride != columns), int32 ranges, explicit scale."""
    q_full, k_full, v_full = make(3, 4, 2, 6, 64, 80, seed=1)
    q = q_full.transpose(1, 2).contiguous().transpose(1, 2)  # same values, non-contiguous strides
    assert not q.is_contiguous()
    k, v = k_full[:, :, :50], v_full[:, :, :50]
    start, end = ranges([(0, 50), (20, 21), (7, 33)], dtype=torch.int32)
    o = da.decode_attention(q, k, v, start, end, scale=0.3)
    ref = da.decode_attention_ref(q, k, v, start, end, scale=0.3)
    torch.testing.assert_close(o, ref, atol=1e-4, rtol=1e-4)


def test_reference_matches_naive():
    q, k, v = make(4, 6, 2, 7, 64, 70, seed=3)
    start, end = ranges(PAIRS)
    ref = da.decode_attention_ref(q, k, v, start, end)
    torch.testing.assert_close(ref.double().cpu(), naive(q.cpu(), k.cpu(), v.cpu(), start.cpu(), end.cpu()),
                               atol=1e-5, rtol=1e-5)
    start, end = ranges([(0, 70), (30, 30), (2, 3), (0, 1)])
    ref = da.decode_attention_ref(q, k, v, start, end)
    assert torch.all(ref[1] == 0) and torch.isfinite(ref).all()
    torch.testing.assert_close(ref.double().cpu(), naive(q.cpu(), k.cpu(), v.cpu(), start.cpu(), end.cpu()),
                               atol=1e-5, rtol=1e-5)


def test_auto_splits_is_static():
    assert da._auto_splits(256, 2, 512, torch.device("cpu"), 64) == 1
    assert da._auto_splits(4, 2, 2048, torch.device("cpu"), 64) == 8
    assert da._auto_splits(4, 2, 64, torch.device("cpu"), 64) == 1


def test_triton_available(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if CUDA:
        assert da.triton_available("cuda")
    # On CPU the env var alone is not enough: triton must also have been imported in interpreter mode.
    assert da.triton_available("cpu") == da._INTERPRETED
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not da.triton_available("cpu")


@pytest.mark.skipif(KERNEL_HERE, reason="the kernel tests run in this process")
def test_kernel_under_interpreter():
    rerun_under_triton_interpreter(__file__)



@pytest.mark.skipif(not CUDA, reason="bf16 tl.dot is wrong under the 3.6 interpreter; GPU only")
def test_bf16_cuda():
    q, k, v = make(8, 8, 2, 7, 128, 300, dtype=torch.bfloat16)
    start, end = ranges([(0, 300), (5, 6), (13, 261), (299, 300), (100, 200), (0, 1), (64, 128), (1, 299)])
    ref = da.decode_attention_ref(q.float(), k.float(), v.float(), start, end)
    for splits in (1, 3):
        o = da.decode_attention(q, k, v, start, end, num_splits=splits)
        torch.testing.assert_close(o.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_cuda_graph_capture():
    q, k, v = make(8, 8, 2, 6, 128, 256, dtype=torch.bfloat16)
    start, end = ranges([(i * 7, 200 + i) for i in range(8)])
    for splits in (1, 4):
        da.decode_attention(q, k, v, start, end, num_splits=splits)  # compile outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o = da.decode_attention(q, k, v, start, end, num_splits=splits)
        end.add_(20)  # replay must see new ranges and new q
        q.normal_()
        graph.replay()
        torch.cuda.synchronize()
        ref = da.decode_attention_ref(q.float(), k.float(), v.float(), start, end)
        torch.testing.assert_close(o.float(), ref, atol=2e-2, rtol=2e-2)
        end.sub_(20)
