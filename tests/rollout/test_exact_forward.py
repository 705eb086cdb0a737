"""The rollout's exact-mode forward (rollout/exact_forward.py) with fused projection copies: where the weights hold
[q; k; v] (with biases) and [gate; up] matrices, the kernels run each as one GEMM at its parts' tile width and the
logits keep the bits of one GEMM per part, the trainer's. On a GPU in bf16; without one,
`test_kernels_under_interpreter` reruns this file with TRITON_INTERPRET=1 (fp32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")
from rollout_helpers import CUDA, DEV, make_model, needs_kernel, rerun_under_triton_interpreter  # noqa: E402

from hybridflow.engine import invariant_kernels  # noqa: E402
from hybridflow.rollout import exact_forward  # noqa: E402
from hybridflow.rollout.forward import RopeTable  # noqa: E402
from hybridflow.rollout.kv_cache import KVCache  # noqa: E402
from hybridflow.rollout.weights import LayerWeights, WeightView, arch_spec  # noqa: E402
from hybridflow.utils import triton_util  # noqa: E402


def _fused_copies(lw: LayerWeights) -> LayerWeights:
    """lw with [q; k; v] (+ biases) and [gate; up] stacked into one matrix each, the parts row views of it."""
    qkv, gate_up = torch.cat([lw.q, lw.k, lw.v]), torch.cat([lw.gate, lw.up])
    q, k, v = qkv.split([lw.q.shape[0], lw.k.shape[0], lw.v.shape[0]])
    qkv_bias = torch.cat([lw.q_bias, lw.k_bias, lw.v_bias])
    qb, kb, vb = qkv_bias.split([lw.q.shape[0], lw.k.shape[0], lw.v.shape[0]])
    gate, up = gate_up.chunk(2)
    return dataclasses.replace(lw, q=q, k=k, v=v, q_bias=qb, k_bias=kb, v_bias=vb, qkv=qkv, qkv_bias=qkv_bias,
                               gate=gate, up=up, gate_up=gate_up)


@needs_kernel
def test_fused_projection_copies_keep_the_bits(monkeypatch):
    """Where the rollout's weights hold fused [q; k; v] (with biases) and [gate; up] copies, the kernels run each as
    one GEMM at the parts' tile width: the logits of one GEMM per part, bit for bit. Narrow widths are patched in so
    that this tiny model's fused matrices (192 and 512 rows) alone would pick wider tiles than their parts (16, 32)."""
    monkeypatch.setattr(invariant_kernels, "_block_n", lambda n: 16 if n <= 128 else 32 if n <= 256 else 64)
    launches = []
    gemm = invariant_kernels.linear
    monkeypatch.setattr(invariant_kernels, "linear", lambda x, w, b, block_n=None: launches.append(
        (w.shape[0], block_n)) or gemm(x, w, b, block_n))
    dtype = torch.bfloat16 if CUDA else torch.float32
    model = make_model("qwen").to(DEV)
    spec = arch_spec(model, dtype)
    w = WeightView(model, dtype, DEV).build()
    layers = w.layers[:2]  # two of the three layers: the interpreter runs every program in Python
    separate = dataclasses.replace(w, layers=[dataclasses.replace(lw, qkv=None, qkv_bias=None, gate_up=None)
                                              for lw in layers])
    fused = dataclasses.replace(w, layers=[_fused_copies(lw) for lw in layers])
    lens = (11, 5)  # two sequences, flat: slot s holds sequence s from column 0
    ids = torch.randint(3, 300, (sum(lens),), generator=torch.Generator().manual_seed(0)).to(DEV)
    pos = torch.cat([torch.arange(n) for n in lens]).to(DEV)
    slot = torch.cat([torch.full((n,), s) for s, n in enumerate(lens)]).to(DEV)
    last = torch.tensor(lens, device=DEV).cumsum(0) - 1

    def logits(weights):
        cache = KVCache(spec, len(lens), 16, dtype, DEV)
        return exact_forward.forward_tokens(weights, spec, RopeTable(model, 16, dtype, DEV), ids, pos, slot, pos,
                                            torch.zeros_like(pos), last, cache)

    ref = logits(separate)
    assert {n for n, _ in launches} == {128, 32, 256, 300} and all(bn is None for _, bn in launches), launches
    launches.clear()
    assert torch.equal(logits(fused), ref)
    assert set(launches) == {(192, 16), (128, None), (512, 32), (300, None)}, launches  # qkv, o and down, gate_up


@pytest.mark.skipif(CUDA or triton_util.INTERPRETED, reason="the kernels run in this process")
def test_kernels_under_interpreter():
    rerun_under_triton_interpreter(__file__)
