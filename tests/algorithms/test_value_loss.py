"""Clipped value loss against a naive per-token loop."""

import pytest
import torch

from hybridflow.algorithms import compute_value_loss


def test_value_loss_matches_naive():
    torch.manual_seed(0)
    B, T = 4, 5
    lengths = torch.tensor([5, 2, 0, 3])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    vpreds, returns, values = torch.randn(B, T), torch.randn(B, T), torch.randn(B, T)
    eps = 0.3
    loss, met = compute_value_loss(vpreds, returns, values, mask, cliprange_value=eps, loss_agg_mode="token-mean")
    tot, n, clipped = 0.0, 0, 0
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            v, r, old = vpreds[i, t].item(), returns[i, t].item(), values[i, t].item()
            vc = min(max(v, old - eps), old + eps)
            l1, l2 = (v - r) ** 2, (vc - r) ** 2
            tot += max(l1, l2)
            clipped += l2 > l1
            n += 1
    assert loss.item() == pytest.approx(0.5 * tot / n, abs=1e-6)
    assert float(met["vf_clipfrac"]) == pytest.approx(clipped / n)
    assert 0 < clipped < n


def test_no_clipping_and_gradient():
    vpreds = torch.tensor([[1.0, 2.0]], requires_grad=True)
    loss, met = compute_value_loss(vpreds, torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), cliprange_value=None)
    assert loss.item() == pytest.approx(0.5 * (1 + 4) / 2)
    loss.backward()
    assert vpreds.grad.tolist() == [[0.5, 1.0]]
    assert float(met["vf_clipfrac"]) == 0.0
    with pytest.raises(ValueError, match="cliprange_value"):
        compute_value_loss(vpreds, vpreds, vpreds, torch.ones(1, 2), cliprange_value=-1)
