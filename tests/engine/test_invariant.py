"""Batch-invariant ops (engine/invariant.py): a row's bits do not depend on how many rows share the call, which
other rows they are, or how many trailing key blocks a query skips; the ops compute what torch's plain ones do."""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hybridflow.engine import attention, invariant


def test_row_ops_are_batch_invariant_and_match_torch() -> None:
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(150, 96, generator=g), torch.randn(200, 96, generator=g), torch.randn(200, generator=g)
    full = invariant.linear(x, w, b)
    torch.testing.assert_close(full, F.linear(x, w, b))
    for m in (1, 2, 3, 5, 64, 65, 149):  # below the CPU gemv cutoff, at and around a tile edge
        assert torch.equal(invariant.linear(x[:m], w, b), full[:m]), m
        assert torch.equal(invariant.linear(x[-m:], w, b), full[-m:]), m  # other tile positions too
    norm = invariant.rms_norm(x, w[0], 1e-6)
    assert torch.equal(invariant.rms_norm(x[7:8], w[0], 1e-6), norm[7:8])
    labels, temp = torch.randint(0, 200, (150,), generator=g), torch.tensor(0.7)
    logp = invariant.token_logprobs(full, labels, temp)
    torch.testing.assert_close(logp, torch.log_softmax(full / 0.7, -1).gather(-1, labels[:, None])[:, 0])
    assert torch.equal(invariant.token_logprobs(full[3:4], labels[3:4], temp), logp[3:4])
    assert invariant.linear(x[:0], w, b).shape == (0, 200)


def test_attention_is_causal_softmax_and_query_invariant() -> None:
    g = torch.Generator().manual_seed(1)
    T, H, Hkv, D = 40, 4, 2, 8
    q, k, v = torch.randn(T, H, D, generator=g), torch.randn(1, Hkv, T, D, generator=g), torch.randn(1, Hkv, T, D,
                                                                                                      generator=g)
    first, last, rows = torch.full((T,), 5), torch.arange(T).clamp(min=5), torch.zeros(T, dtype=torch.long)
    blocks = -(-T // invariant.KEY_BLOCK)
    o = invariant.attention(q, k, v, rows, first, last, blocks, D ** -0.5)
    ref = F.scaled_dot_product_attention(q[5:].transpose(0, 1)[None], k[:, :, 5:], v[:, :, 5:], is_causal=True,
                                         enable_gqa=True)[0].transpose(0, 1)
    torch.testing.assert_close(o[5:], ref)
    # one query alone, and with more (fully masked) key blocks than it needs: the same bits
    alone = invariant.attention(q[20:21], k, v, rows[20:21], first[20:21], last[20:21], 1 + 20 // invariant.KEY_BLOCK,
                                D ** -0.5)
    assert torch.equal(alone, o[20:21])
    assert torch.equal(invariant.attention(q, k, v, rows, first, last, blocks + 3, D ** -0.5), o)


class _CountOps(TorchDispatchMode):
    """How many times each aten op ran."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def test_row_op_backward_is_the_plain_gradient_in_one_pass() -> None:
    """Backward is one GEMM per gradient over all rows (not one per tile) and equals the plain op's gradient;
    the forward keeps the batch-invariant bits."""
    g = torch.Generator().manual_seed(2)
    x, w, b = (torch.randn(*s, generator=g, requires_grad=True) for s in ((3, 100, 48), (40, 48), (40,)))
    dy = torch.randn(3, 100, 40, generator=g)
    y = invariant.linear(x, w, b)
    assert torch.equal(y.detach(), invariant.rowwise(lambda t: F.linear(t, w, b), x).detach())
    with _CountOps() as ops:
        grads = torch.autograd.grad(y, (x, w, b), dy)
    assert ops.counts["mm"] + ops.counts["addmm"] + ops.counts["bmm"] <= 2, ops.counts  # 300 rows: 5 tiles
    for got, want in zip(grads, torch.autograd.grad(F.linear(x, w, b), (x, w, b), dy)):
        torch.testing.assert_close(got, want)
    y = invariant.rms_norm(x, w[0], 1e-6)
    assert torch.equal(y.detach(), invariant.rowwise(lambda t: invariant._rms_norm(t, w[0], 1e-6), x).detach())
    dy = torch.randn(3, 100, 48, generator=g)
    with _CountOps() as ops:
        grads = torch.autograd.grad(y, (x, w), dy)
    assert ops.counts["cat"] == 0, ops.counts  # no tiles in backward
    plain = w[0] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    for got, want in zip(grads, torch.autograd.grad(plain, (x, w), dy)):
        torch.testing.assert_close(got, want)

def test_packed_attention_backward_differentiates_the_plain_attention_once() -> None:
    g = torch.Generator().manual_seed(3)
    T, H, Hkv, D = 50, 4, 2, 8
    q, k, v = (torch.randn(1, h, T, D, generator=g, requires_grad=True) for h in (H, Hkv, Hkv))
    cu = torch.tensor([0, 20, 50])
    calls = []

    def plain(q_, k_, v_):
        calls.append(1)
        return attention._padded_sdpa(q_, k_, v_, cu, D ** -0.5, None, None)

    o = invariant.packed_attention(q, k, v, cu, D ** -0.5, plain)
    assert not calls
    assert torch.equal(o.detach(), invariant._packed_attention(q, k, v, cu, D ** -0.5))
    torch.testing.assert_close(o, plain(q, k, v))
    do = torch.randn(o.shape, generator=g)
    calls.clear()
    grads = torch.autograd.grad(o, (q, k, v), do)
    assert len(calls) == 1
    for got, want in zip(grads, torch.autograd.grad(plain(q, k, v), (q, k, v), do)):
        assert torch.equal(got, want)
