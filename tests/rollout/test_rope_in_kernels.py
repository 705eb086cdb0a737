"""RoPE inside the decode kernels (`DecodeOps.rope_in_kernels`): the K/V-store kernel rotates k and the
decode-attention kernel rotates q from each row's cos/sin in fp32 with one rounding (as the compiled
`forward.apply_rope`; eager bf16 torch rounds after each op). Checked against the exact RoPE in fp64: within two
rounding steps of the dtype per term (eager's error bound; one rounding, or an FMA in fp32, is within it), and bit for
bit equal to eager torch in fp32 under the Triton interpreter (a subprocess with TRITON_INTERPRET=1; there bf16 is
only close: the interpreter truncates fp32 -> bf16, and its bf16 tl.dot is wrong). On a GPU the kernels run
natively. The wiring in `forward.decode` is also checked through the torch references on the CPU."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from rollout_helpers import CUDA, DEV, needs_kernel, rerun_under_triton_interpreter

pytest.importorskip("triton")
from rollout_helpers import make_engine  # noqa: E402
from test_decode_fusion import P, model_of, run_decode  # noqa: E402

from hybridflow.rollout import forward  # noqa: E402
from hybridflow.rollout.decode_attention import decode_attention, decode_attention_ref  # noqa: E402
from hybridflow.rollout.kv_store_kernel import store_kv, store_kv_ref  # noqa: E402
from hybridflow.utils import triton_util  # noqa: E402


def assert_rope_close(got, x, cos, sin):
    """got (rows of x [b, ..., D] with RoPE applied by a kernel) within 2 units of roundoff of the dtype times
    |x cos| + |rotate_half(x) sin| of the exact fp64 RoPE — the bound of eager per-op rounding, which one rounding
    (or an fp32 FMA) also meets; a wrong offset, sign or row is off by O(|x|)."""
    x64, c64, s64 = x.double(), cos.double(), sin.double()
    rot = torch.cat([-x64[..., x.shape[-1] // 2:], x64[..., :x.shape[-1] // 2]], -1)
    exact = x64 * c64 + rot * s64
    u = 2.0 ** -8 if x.dtype == torch.bfloat16 else torch.finfo(x.dtype).eps / 2
    bound = 2 * u * ((x64 * c64).abs() + (rot * s64).abs()) + 1e-30
    err = (got.double() - exact).abs()
    assert (err <= bound).all(), f"max err/bound {(err / bound).max().item():.3g}"


def rope_rows(b, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    ang = torch.rand(b, d // 2, generator=g) * 50
    ang = torch.cat([ang, ang], -1)
    return ang.cos().to(DEV, dtype), ang.sin().to(DEV, dtype)


@pytest.mark.parametrize("kind", ["tiny", "qwen", "qwen3"])  # qwen: fused q/k/v with bias, k and q strided views
def test_decode_wiring_through_the_torch_references(kind):
    runner = make_engine(model_of(kind), P, 6)._prepare()
    ops = forward.DecodeOps(attention=decode_attention_ref, kv_store=store_kv_ref)
    a = run_decode(runner, dataclasses.replace(ops, rope_in_kernels=True))
    b = run_decode(runner, dataclasses.replace(ops, rope_in_kernels=False))
    assert torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1] + a[2], b[1] + b[2]))


def test_rope_in_kernels_is_the_default_only_with_both_kernels():
    """On by default, but it acts only where both kernels take cos/sin: with the torch K/V write (kv_store None)
    decode applies RoPE itself and never hands cos/sin to the attention."""
    assert forward.DecodeOps().rope_in_kernels and forward.DecodeOps.compiled().rope_in_kernels
    runner = make_engine(model_of("qwen3"), P, 6)._prepare()

    def attention_without_rope(q, kc, vc, start, end, scale=None, rows=None, **rope):
        assert not rope, "cos/sin reached the attention although K was written by torch"
        return decode_attention_ref(q, kc, vc, start, end, scale, rows=rows)

    a = run_decode(runner, forward.DecodeOps(attention=attention_without_rope))
    b = run_decode(runner, forward.DecodeOps(attention=decode_attention_ref, rope_in_kernels=False))
    assert torch.equal(a[0], b[0])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_rope_equals_torch_rope(dtype):
    b, hkv, T, d = 5, 2, 24, 64
    g = torch.Generator().manual_seed(1)
    kc, vc = (torch.randn(b + 2, hkv, T, d, generator=g).to(DEV, dtype) for _ in range(2))
    qkv = torch.randn(b, (4 + 2 * hkv) * d, generator=g).to(DEV, dtype)  # strided k/v views, as forward's
    k = qkv[:, 4 * d:(4 + hkv) * d].unflatten(-1, (hkv, d))
    v = qkv[:, (4 + hkv) * d:].unflatten(-1, (hkv, d))
    cidx = torch.tensor([0, 3, 7, 23, 11], device=DEV)
    cos, sin = rope_rows(b, d, dtype)
    want_k, want_v = kc.clone(), vc.clone()
    store_kv_ref(want_k, want_v, k, v, cidx, cos=cos, sin=sin)
    store_kv(kc, vc, k, v, cidx, cos=cos, sin=sin)
    assert torch.equal(vc, want_v)
    rows = torch.arange(b, device=DEV)
    untouched = torch.ones(T, dtype=torch.bool, device=DEV)
    untouched[cidx] = False
    assert torch.equal(kc[:, :, untouched], want_k[:, :, untouched]) and torch.equal(kc[b:], want_k[b:])
    if dtype == torch.float32 and not CUDA:  # interpreter: numpy's separate mul and add, as eager torch
        assert torch.equal(kc, want_k)
    elif CUDA:  # one rounding (and an fp32 FMA) vs eager's per-op rounding: within the bound of both
        assert_rope_close(kc[rows, :, cidx], k, cos[:, None], sin[:, None])
    else:  # the interpreter casts fp32 -> bf16 by truncation (compiled Triton rounds to nearest even, as torch)
        torch.testing.assert_close(kc, want_k, atol=2e-2, rtol=2e-2)
    assert not torch.equal(want_k[rows, :, cidx], k)  # RoPE really acted


BF16_GPU = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not CUDA, reason="bf16 tl.dot is wrong under the "
                                                                 "3.6 interpreter; GPU only"))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, BF16_GPU])
def test_decode_attention_rope_equals_torch_rope(dtype):
    b, hkv, G, T, d = 4, 2, 3, 40, 64
    g = torch.Generator().manual_seed(2)
    kc, vc = (torch.randn(b, hkv, T, d, generator=g).to(DEV, dtype) for _ in range(2))
    q = torch.randn(b, hkv, G, d, generator=g).to(DEV, dtype)
    start = torch.tensor([0, 5, 0, 9], device=DEV)
    end = torch.tensor([40, 17, 1, 30], device=DEV)
    cos, sin = rope_rows(b, d, dtype)
    roped = forward.apply_rope(q, cos[:, None, None], sin[:, None, None])
    got = decode_attention(q, kc, vc, start, end, cos=cos, sin=sin)
    if CUDA:  # the kernel's q RoPE rounds once, eager's per op (see assert_rope_close)
        torch.testing.assert_close(got, decode_attention(roped, kc, vc, start, end),
                                   atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)
    else:
        assert torch.equal(got, decode_attention(roped, kc, vc, start, end))
    ref = decode_attention_ref(q, kc, vc, start, end, cos=cos, sin=sin)
    torch.testing.assert_close(got, ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("kind", ["tiny", "qwen", "qwen3"])
def test_decode_with_rope_in_kernels_equals_torch_rope(kind):
    runner = make_engine(model_of(kind).to(DEV), P, 6)._prepare()
    runner.cache = copy.deepcopy(runner.cache)
    ops = forward.DecodeOps(attention=decode_attention, kv_store=store_kv)
    a = run_decode(runner, dataclasses.replace(ops, rope_in_kernels=True))
    b = run_decode(runner, dataclasses.replace(ops, rope_in_kernels=False))
    if CUDA:  # the runner computes in bf16 here: the kernels round RoPE once, eager torch after each op; a wrong
        # rotation, offset or row would be off by the values' own size
        for x, y in zip([a[0]] + a[1] + a[2], [b[0]] + b[1] + b[2]):
            torch.testing.assert_close(x.float(), y.float(), rtol=0, atol=0.05 * y.float().abs().max().item())
    else:
        assert torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1] + a[2], b[1] + b[2]))


def test_mismatched_rope_rows_are_refused():
    k = torch.zeros(2, 2, 64)
    cos = torch.zeros(3, 64)
    with pytest.raises(ValueError, match="cos/sin"):
        store_kv(torch.zeros(2, 2, 8, 64), torch.zeros(2, 2, 8, 64), k, k, torch.zeros(2, dtype=torch.long),
                 cos=cos, sin=cos)


@pytest.mark.skipif(CUDA or triton_util.INTERPRETED, reason="the kernel runs in this process")
def test_kernel_under_interpreter():
    rerun_under_triton_interpreter(__file__)
