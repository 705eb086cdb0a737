"""The Triton forms of the batch-invariant ops (engine/invariant_kernels.py): a row's bits do not depend on how many
rows share the call (batch sizes 1, 3, 64, 200, at the front and at the back; linear, RMSNorm, log-sum-exp, attention), a decode query over the KV cache
gets the bits of the same query in a packed causal call, a fused matrix run at its parts' tile width gives each part
its own GEMM's bits, and the values are those of the torch forms up to rounding. In-process on a GPU (bf16 and fp32); without one, `test_kernels_under_interpreter` reruns this file with
TRITON_INTERPRET=1 (fp32: the interpreter's bf16 dot is not the GPU's).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from rollout.rollout_helpers import CUDA, DEV, needs_kernel, rerun_under_triton_interpreter  # noqa: E402

from hybridflow.engine import invariant, invariant_kernels  # noqa: E402
from hybridflow.utils import triton_util  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]
# the interpreter runs each program in Python: fewer rows, shorter sequences, smaller key blocks there
ROWS, BATCHES, KEY_BLOCK = (200, (1, 3, 64, 200), 64) if CUDA else (20, (1, 3, 20), 8)


@pytest.fixture(autouse=True)
def _fixed_order_interpreted_dot(monkeypatch):
    """Under the interpreter `tl.dot` is numpy's matmul, i.e. the host's BLAS, and on some CPUs (an AMD EPYC: rows
    1-32 of a [64, K] @ [K, N] product get other bits than the same rows alone) its bits for a row depend on where the
    row sits in the tile. The kernels' invariance is a property of their tiling, masking and k-loop given a dot whose
    every element is summed in one fixed order — what the GPU's dot gives and the in-process GPU run checks. So here
    the interpreter's dot sums over k in a fixed order (float32, no BLAS): the test checks the kernels, not the host
    BLAS."""
    if not triton_util.INTERPRETED:
        return
    from triton.runtime import interpreter

    real = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:
            return real(self, a, b, d, input_precision, max_num_imprecise_acc)
        x, y = a.data.astype(d.data.dtype), b.data.astype(d.data.dtype)
        prod = x[..., :, :1] * y[..., :1, :]
        for k in range(1, x.shape[-1]):
            prod = prod + x[..., :, k:k + 1] * y[..., k:k + 1, :]
        return interpreter.TensorHandle(prod + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def _rand(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,bias", [(130, 96, True), (200, 64, False)])
def test_linear_rows_do_not_depend_on_the_batch(dtype, N, K, bias):
    x, w = _rand(ROWS, K, dtype=dtype, seed=0), _rand(N, K, dtype=dtype, seed=1) / K ** 0.5
    b = _rand(N, dtype=dtype, seed=2) if bias else None
    full = invariant_kernels.linear(x, w, b)
    for m in BATCHES:
        assert torch.equal(invariant_kernels.linear(x[:m], w, b), full[:m]), m
        assert torch.equal(invariant_kernels.linear(x[-m:], w, b), full[-m:]), m
    torch.testing.assert_close(full, F.linear(x, w, b), **({} if dtype == torch.float32 else dict(atol=2e-2,
                                                                                                  rtol=2e-2)))
    assert torch.equal(invariant_kernels.linear(x.view(4, -1, K), w, b), full.view(4, -1, N))
    assert invariant_kernels.linear(x[:0], w, b).shape == (0, N)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes,K,bias", [((3584, 512, 512), 64, True),  # Qwen2.5-7B's q/k/v rows
                                          ((200, 3968), 64, False)])  # a part boundary inside a tile
def test_fused_matrix_gives_each_part_its_own_bits(dtype, sizes, K, bias, monkeypatch):
    """One GEMM of the stacked parts at the parts' tile width = each part's own GEMM, bit for bit, where the stacked
    matrix alone would get a wider tile (the rollout's fused [q; k; v] against the trainer's q, k, v). The
    interpreter's dot (numpy) rarely depends on the width, so the launch's width is checked as well."""
    widths = []
    kernel = invariant_kernels._linear_kernel

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                widths.append(meta["BLOCK_N"])
                return kernel[grid](*args, **meta)
            return launch

    monkeypatch.setattr(invariant_kernels, "_linear_kernel", Recorded())
    assert invariant_kernels.shared_block_n(sizes) != invariant_kernels._block_n(sum(sizes))
    x, w = _rand(ROWS, K, dtype=dtype, seed=10), _rand(sum(sizes), K, dtype=dtype, seed=11) / K ** 0.5
    b = _rand(sum(sizes), dtype=dtype, seed=12) if bias else None
    assert invariant.fusable(x, sizes)
    parts = invariant.split_linear(x, w, b, sizes)
    assert widths == [invariant_kernels.shared_block_n(sizes)], widths
    for i, (part, got) in enumerate(zip(w.split(sizes), parts)):
        part_b = None if b is None else b.split(sizes)[i]
        assert torch.equal(got, invariant_kernels.linear(x, part, part_b)), (sizes, i)
    m = BATCHES[1]  # and still row-invariant
    assert all(torch.equal(p[:m], q) for p, q in zip(parts, invariant.split_linear(x[:m], w, b, sizes)))


def test_split_linear_refuses_parts_of_other_tile_widths():
    """Parts whose own GEMMs run at different widths have no fused launch with their bits: `fusable` says no and
    `split_linear` refuses, naming the widths; a tile width tl.dot cannot run is refused too."""
    x, w = torch.randn(3, 16, device=DEV), torch.randn(4224 + 512, 16, device=DEV)
    assert not invariant.fusable(x, (4224, 512))
    with pytest.raises(ValueError, match=r"tile widths \[128, 64\].*call `linear` per part"):
        invariant.split_linear(x, w, None, (4224, 512))
    with pytest.raises(ValueError, match="do not stack parts"):
        invariant.split_linear(x, w, None, (4224, 500))
    with pytest.raises(ValueError, match="block_n=48 must be a power of two"):
        invariant_kernels.linear(x, w, None, block_n=48)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rows_do_not_depend_on_the_batch(dtype):
    x, w = _rand(ROWS, 2, 96, dtype=dtype, seed=3), _rand(96, dtype=dtype, seed=4)
    full = invariant_kernels.rms_norm(x, w, 1e-6)
    for m in BATCHES:
        assert torch.equal(invariant_kernels.rms_norm(x[:m], w, 1e-6), full[:m]), m
        assert torch.equal(invariant_kernels.rms_norm(x[-m:], w, 1e-6), full[-m:]), m
    torch.testing.assert_close(full, invariant._rms_norm(x, w, 1e-6), atol=1e-5 if dtype == torch.float32 else 1e-2,
                               rtol=1e-5 if dtype == torch.float32 else 1e-2)
    w32 = w.float()  # an fp32 weight on a low-precision input: torch's promotion, an fp32 result
    assert invariant_kernels.rms_norm(x, w32, 1e-6).dtype == torch.promote_types(dtype, torch.float32)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_logsumexp_rows_do_not_depend_on_the_batch(dtype):
    V = 5000 if CUDA else 300  # CUDA: more than one 4096-wide chunk
    z, temp = _rand(ROWS, V, dtype=dtype, seed=9) * 4, torch.tensor(0.7, device=DEV)
    full = invariant_kernels.logsumexp(z, temp)
    for m in BATCHES:
        assert torch.equal(invariant_kernels.logsumexp(z[:m], temp), full[:m]), m
        assert torch.equal(invariant_kernels.logsumexp(z[-m:], temp), full[-m:]), m
    torch.testing.assert_close(full, torch.logsumexp(z.float() / 0.7, -1))
    labels = torch.randint(0, V, (ROWS,), device=DEV)
    torch.testing.assert_close(invariant.token_logprobs(z, labels, temp),
                               torch.log_softmax(z.float() / 0.7, -1).gather(-1, labels[:, None])[:, 0])


def _cache(S, hkv, C, D, dtype, seed):
    return _rand(S, hkv, C, D, dtype=dtype, seed=seed), _rand(S, hkv, C, D, dtype=dtype, seed=seed + 1)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_packed_and_decode_queries_share_bits(dtype, monkeypatch):
    """Slot s holds a sequence from column `first[s]`; every position's query in one packed causal call, any subset
    of them, and each slot's last query alone (decode over the cache) give the same bits; the values are the torch
    form's (which runs in blocks of 64 keys, as the kernel)."""
    monkeypatch.setattr(invariant, "KEY_BLOCK", KEY_BLOCK)
    S, H, hkv, D = 4, 6, 2, 64
    C, B = 3 * KEY_BLOCK, KEY_BLOCK  # a query meets up to three key blocks
    kc, vc = _cache(S, hkv, C, D, dtype, seed=5)
    first_S = torch.tensor([0, 7, B + B // 8, 0], device=DEV)
    last_S = torch.tensor([C - 1, B + B // 4, 2 * B + B // 8, 0], device=DEV)
    rows = torch.cat([torch.full((int(last_S[s] - first_S[s]) + 1,), s) for s in range(S)]).to(DEV)
    last = torch.cat([torch.arange(int(first_S[s]), int(last_S[s]) + 1) for s in range(S)]).to(DEV)
    first = first_S[rows]
    q = _rand(rows.numel(), H, D, dtype=dtype, seed=7)
    scale = D ** -0.5
    full = invariant_kernels.attention(q, kc, vc, rows, first, last, scale, invariant.KEY_BLOCK)
    for m in BATCHES:
        assert torch.equal(invariant_kernels.attention(q[:m], kc, vc, rows[:m], first[:m], last[:m], scale,
                                                       invariant.KEY_BLOCK), full[:m]), m
        assert torch.equal(invariant_kernels.attention(q[-m:], kc, vc, rows[-m:], first[-m:], last[-m:], scale,
                                                       invariant.KEY_BLOCK), full[-m:]), m
    ends = torch.cumsum(last_S - first_S + 1, 0) - 1  # each slot's last query: a decode step over the cache
    decode = invariant_kernels.attention(q[ends], kc, vc, torch.arange(S, device=DEV), first_S, last_S, scale,
                                         invariant.KEY_BLOCK)
    assert torch.equal(decode, full[ends])
    ref = invariant._attention_tile(q, kc, vc, rows, first, last, -(-C // invariant.KEY_BLOCK), scale, hkv)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(full, ref.to(dtype), **tol)


@needs_kernel
def test_the_invariant_ops_route_through_the_kernels(monkeypatch):
    """On a device with Triton, `invariant.linear` / `rms_norm` / `attention` are the kernels (the trainer and the
    rollout call those); a kernel replaced by a marker shows up in the result."""
    x = _rand(5, 32, dtype=torch.float32, seed=8)
    assert invariant._on_kernels(x)
    monkeypatch.setattr(invariant_kernels, "linear",
                        lambda x, w, b, block_n=None: torch.full((x.shape[0], w.shape[0]), 7.0))
    monkeypatch.setattr(invariant_kernels, "rms_norm", lambda x, w, eps: torch.full_like(x, 8.0))
    assert (invariant.linear(x, x) == 7).all() and (invariant.rms_norm(x, x[0], 1e-6) == 8).all()


@pytest.mark.skipif(CUDA or triton_util.INTERPRETED, reason="the kernels run in this process")
def test_kernels_under_interpreter():
    rerun_under_triton_interpreter(__file__)
