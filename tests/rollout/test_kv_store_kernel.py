"""The one-launch K/V cache write vs the `index_put` it replaces in `forward.decode`: the same cache bit for bit,
every other column untouched, strided new K/V (views of the fused qkv output), CUDA-graph replay on a GPU.

Runs the kernel in-process on a GPU; without one, `test_kernel_under_interpreter` reruns this file in a subprocess
with TRITON_INTERPRET=1 (triton fixes its mode when first imported, which torch >= 2.13 does with torch itself).
"""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import (
    CUDA,
    DEV,
    make_engine,
    make_model,
    make_prompts,
    needs_kernel,
    rerun_under_triton_interpreter,
)

pytest.importorskip("triton")
from hybridflow.rollout import forward  # noqa: E402
from hybridflow.rollout.decode_attention import decode_attention_ref  # noqa: E402
from hybridflow.rollout.kv_store_kernel import store_kv, store_kv_ref  # noqa: E402
from hybridflow.utils import triton_util  # noqa: E402


def make(S, b, hkv, T, d, dtype, seed=0):
    """Random caches [S, Hkv, T, D], new K/V [b, Hkv, D] and distinct-row columns including 0 and T - 1."""
    g = torch.Generator().manual_seed(seed)
    kc, vc = (torch.randn(S, hkv, T, d, generator=g).to(DEV, dtype) for _ in range(2))
    k, v = (torch.randn(b, hkv, d, generator=g).to(DEV, dtype) for _ in range(2))
    cidx = torch.randint(0, T, (b,), generator=g)
    cidx[0] = 0
    cidx[-1] = T - 1
    return kc, vc, k, v, cidx.to(DEV)


def index_put(kc, vc, k, v, cidx):
    """`forward.decode`'s torch path."""
    rows = torch.arange(k.shape[0], device=k.device)
    kc[rows, :, cidx] = k
    vc[rows, :, cidx] = v


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_map_writes_tokens_of_one_slot_to_their_columns(dtype):
    """A multi-turn extension writes several tokens of a slot (rows repeat, columns differ), and padding repeats
    the last token exactly (same row, column and values): equal to index_put bit for bit, nothing else touched."""
    kc, vc, k, v, _ = make(5, 6, 2, 40, 64, dtype, seed=3)
    rows = torch.tensor([3, 3, 3, 0, 4, 4], device=DEV)
    cols = torch.tensor([10, 11, 12, 0, 39, 39], device=DEV)
    k[5], v[5] = k[4], v[4]  # the duplicate carries identical values
    want_k, want_v = kc.clone(), vc.clone()
    store_kv_ref(want_k, want_v, k, v, cols, rows)
    store_kv(kc, vc, k, v, cols, rows)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert torch.equal(kc[3, :, 10:13], k[:3].transpose(0, 1)) and torch.equal(kc[1], want_k[1])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,b,hkv,T,d", [(4, 4, 2, 32, 64), (6, 3, 1, 48, 128), (5, 5, 4, 17, 128),
                                          (8, 1, 2, 16, 80), (3, 2, 3, 64, 64)])
def test_kernel_matches_index_put(dtype, S, b, hkv, T, d):
    kc, vc, k, v, cidx = make(S, b, hkv, T, d, dtype, seed=S * d + b)
    ref_k, ref_v = kc.clone(), vc.clone()
    index_put(ref_k, ref_v, k, v, cidx)
    before_k, before_v = kc.clone(), vc.clone()
    store_kv(kc, vc, k, v, cidx)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)  # bitwise, incl. rows >= b and every other column
    written = torch.zeros(S, T, dtype=torch.bool, device=DEV)
    written[torch.arange(b, device=DEV), cidx] = True
    assert torch.equal(kc.transpose(1, 2)[~written], before_k.transpose(1, 2)[~written])
    assert torch.equal(vc.transpose(1, 2)[~written], before_v.transpose(1, 2)[~written])


@needs_kernel
def test_strided_new_kv_from_fused_qkv():
    """k, v as `forward.qkv` returns them from a fused projection: views with a row stride of (H + 2 Hkv) D."""
    h, hkv, d, b = 8, 2, 64, 3
    kc, vc, _, _, cidx = make(4, b, hkv, 20, d, torch.float32)
    fused = torch.randn(b, (h + 2 * hkv) * d, device=DEV)
    _, k, v = fused.split([h * d, hkv * d, hkv * d], dim=-1)
    k, v = k.unflatten(-1, (hkv, d)), v.unflatten(-1, (hkv, d))
    assert not k.is_contiguous()
    ref_k, ref_v = kc.clone(), vc.clone()
    index_put(ref_k, ref_v, k, v, cidx)
    store_kv(kc, vc, k, v, cidx)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


@needs_kernel
def test_decode_with_the_kernel_generates_like_index_put(monkeypatch):
    """`forward.decode` through `DecodeOps.kv_store` (slots reused: 27 rows through 8) vs the index_put path."""
    model = make_model("qwen").to(DEV)
    prompts = make_prompts(9, 12, model.config.vocab_size, seed=3, meta={"n": 3, "seeds": list(range(9))})
    monkeypatch.setattr(forward, "_triton_attention", lambda device: decode_attention_ref)
    plain = make_engine(model, max_num_seqs=8, enforce_eager=True).generate(prompts)
    monkeypatch.setattr(forward, "_triton_kv_store", lambda device: store_kv)
    engine = make_engine(model, max_num_seqs=8, enforce_eager=True)
    out = engine.generate(prompts)
    assert engine._runner.ops.kv_store is store_kv
    assert torch.equal(out.batch["responses"], plain.batch["responses"])
    assert torch.equal(out.batch["rollout_log_probs"], plain.batch["rollout_log_probs"])


def test_mismatches_are_refused():
    kc, vc, k, v, cidx = make(2, 2, 2, 16, 64, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        store_kv(kc, vc, k.double(), v, cidx)
    with pytest.raises(ValueError, match="does not hold"):
        store_kv(kc[:1], vc[:1], k, v, cidx)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_matches_index_put():
    """The Qwen2-0.5B decode shape: 256 rows, 2 kv heads, D = 64, bf16; replay sees new K/V and new columns."""
    kc, vc, k, v, cidx = make(256, 256, 2, 512, 64, torch.bfloat16)
    store_kv(kc, vc, k, v, cidx)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_kv(kc, vc, k, v, cidx)
    ref_k, ref_v = kc.clone(), vc.clone()
    k.normal_()
    v.normal_()
    cidx.add_(1).clamp_(max=511)
    index_put(ref_k, ref_v, k, v, cidx)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


@pytest.mark.skipif(CUDA or triton_util.INTERPRETED, reason="the kernel runs in this process")
def test_kernel_under_interpreter():
    rerun_under_triton_interpreter(__file__)
