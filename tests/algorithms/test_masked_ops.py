"""masked_sum/mean/var/whiten and entropy against naive Python references."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.algorithms import (
    entropy_from_logits,
    entropy_from_logits_chunked,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)


def naive_stats(x, m):
    vals = [x[i][j] for i in range(len(x)) for j in range(len(x[0])) if m[i][j]]
    n = len(vals)
    mean = sum(vals) / n if n else 0.0
    var = sum((v - mean) ** 2 for v in vals) / (n - 1) if n > 1 else 0.0
    return sum(vals), mean, var


masks = st.integers(1, 6).flatmap(
    lambda b: st.integers(1, 9).flatmap(
        lambda t: st.lists(st.lists(st.booleans(), min_size=t, max_size=t), min_size=b, max_size=b)
    )
)


@settings(max_examples=60, deadline=None)
@given(mask=masks, seed=st.integers(0, 2**16))
def test_masked_reductions_match_naive(mask, seed):
    m = torch.tensor(mask)
    x = torch.randn(m.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    s, mean, var = naive_stats(x.tolist(), mask)
    assert masked_sum(x, m).item() == pytest.approx(s, abs=1e-12)
    assert masked_mean(x, m).item() == pytest.approx(mean, abs=1e-12)
    assert masked_var(x, m).item() == pytest.approx(var, abs=1e-12)
    w = masked_whiten(x, m)
    for i, row in enumerate(mask):
        for j, valid in enumerate(row):
            if valid:
                assert w[i, j].item() == pytest.approx((x[i, j].item() - mean) / math.sqrt(var + 1e-8), abs=1e-9)
    w2 = masked_whiten(x, m, shift_mean=False)
    assert torch.allclose(w2, w + mean)
    # per-row mean (dim=-1)
    rows = masked_mean(x, m, dim=-1)
    for i, row in enumerate(mask):
        _, rm, _ = naive_stats([x[i].tolist()], [row])
        assert rows[i].item() == pytest.approx(rm, abs=1e-12)


def test_empty_mask_gives_zero_not_nan():
    x = torch.randn(3, 4)
    m = torch.zeros(3, 4)
    assert masked_mean(x, m).item() == 0.0
    assert masked_var(x, m).item() == 0.0
    assert not torch.isnan(masked_whiten(x, m)).any()
    assert masked_mean(x, m, dim=-1).tolist() == [0.0, 0.0, 0.0]


def naive_entropy(row):
    mx = max(row)
    z = sum(math.exp(v - mx) for v in row)
    ps = [math.exp(v - mx) / z for v in row]
    return -sum(p * math.log(p) for p in ps if p > 0)


def test_entropy_matches_naive_and_is_stable():
    torch.manual_seed(0)
    logits = torch.randn(4, 5, 11, dtype=torch.float64) * 3
    logits[0, 0, :5] = float("-inf")
    logits[1, 1] *= 1e4  # huge logits: naive softmax would overflow
    h = entropy_from_logits(logits)
    assert h.shape == (4, 5)
    assert torch.isfinite(h).all()
    for i in range(4):
        for j in range(5):
            assert h[i, j].item() == pytest.approx(naive_entropy(logits[i, j].tolist()), abs=1e-9)
    assert h[2, 0].item() <= math.log(11) + 1e-9
    assert entropy_from_logits(torch.zeros(7)).item() == pytest.approx(math.log(7), abs=1e-6)


def test_entropy_bf16_is_computed_in_float32():
    logits = torch.randn(3, 50).bfloat16()
    h = entropy_from_logits(logits)
    assert h.dtype == torch.float32
    assert torch.allclose(h, entropy_from_logits(logits.float()))


def test_chunked_entropy_equals_unchunked_values_and_grads():
    torch.manual_seed(1)
    base = torch.randn(3, 7, 13)
    a = base.clone().requires_grad_(True)
    b = base.clone().requires_grad_(True)
    ha = entropy_from_logits(a)
    hb = entropy_from_logits_chunked(b, chunk_size=4)
    assert torch.allclose(ha, hb, atol=1e-6)
    w = torch.randn(3, 7)
    (ha * w).sum().backward()
    (hb * w).sum().backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-6)
    with torch.no_grad():
        assert torch.allclose(entropy_from_logits_chunked(base, chunk_size=100), ha.detach(), atol=1e-6)
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits_chunked(base, chunk_size=0)


def test_whiten_is_differentiable():
    torch.manual_seed(2)
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    m = (torch.rand(3, 5) > 0.3).double()
    w = torch.randn(3, 5, dtype=torch.float64)
    (masked_whiten(x, m) * w * m).sum().backward()
    y = x.detach().clone().requires_grad_(True)
    vals = y[m.bool()]
    ref = (y - vals.mean()) / torch.sqrt(vals.var() + 1e-8)
    (ref * w * m).sum().backward()
    assert torch.allclose(x.grad, y.grad, atol=1e-10)
