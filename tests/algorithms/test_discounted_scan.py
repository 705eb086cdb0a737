"""The chunked discounted scan against a per-element Python loop, including masks with holes."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.algorithms.discounted import (
    discounted_reverse_cumsum,
    is_contiguous_mask,
    masked_discounted_returns,
)


def naive_scan(x, c):
    out = [[0.0] * len(r) for r in x]
    for i, row in enumerate(x):
        run = 0.0
        for t in reversed(range(len(row))):
            run = row[t] + c * run
            out[i][t] = run
    return out


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 4),
    t=st.integers(1, 150),
    k=st.integers(2, 40),
    c=st.sampled_from([0.0, 0.5, 0.9, 0.99, 1.0]),
    seed=st.integers(0, 1000),
)
def test_scan_matches_loop(b, t, k, c, seed):
    x = torch.randn(b, t, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    got = discounted_reverse_cumsum(x, c, chunk_size=k)
    ref = torch.tensor(naive_scan(x.tolist(), c), dtype=torch.float64)
    assert torch.allclose(got, ref, atol=1e-9)


def test_scan_long_sequence_float32():
    x = torch.randn(3, 4096)
    ref = torch.tensor(naive_scan(x.double().tolist(), 0.999))
    got = discounted_reverse_cumsum(x, 0.999)
    assert torch.allclose(got.double(), ref.double(), atol=1e-3, rtol=1e-5)


def test_contiguity_detection():
    assert is_contiguous_mask(torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 0]]))
    assert not is_contiguous_mask(torch.tensor([[1, 0, 1, 0]]))


def test_masked_returns_skip_holes():
    r = torch.tensor([[1.0, 5.0, 2.0, 3.0, 7.0]])
    m = torch.tensor([[1, 0, 1, 1, 0]])
    got = masked_discounted_returns(r, m, 0.5)
    # valid rewards 1, 2, 3 → returns 1 + 0.5·2 + 0.25·3, 2 + 0.5·3, 3; masked positions 0.
    assert got.tolist() == [[pytest.approx(2.75), 0.0, pytest.approx(3.5), pytest.approx(3.0), 0.0]]


def test_chunk_size_validated():
    with pytest.raises(ValueError, match="chunk_size"):
        discounted_reverse_cumsum(torch.ones(1, 3), 0.9, chunk_size=1)
