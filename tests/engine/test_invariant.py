"""Batch-invariant ops (engine/invariant.py): a row's bits do not depend on how many rows share the call, which
other rows they are, or how many trailing key blocks a query skips; the ops compute what torch's plain ones do."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridflow.engine import invariant


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
