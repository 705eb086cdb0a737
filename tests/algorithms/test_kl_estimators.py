"""KL estimators against their per-element formulas; aliases; k3 clamping; k3+ straight-through gradient."""

import math

import pytest
import torch

from hybridflow.algorithms import KL_ESTIMATORS, kl_penalty

FORMULAS = {
    "k1": lambda lp, ref: lp - ref,
    "abs": lambda lp, ref: abs(lp - ref),
    "k2": lambda lp, ref: 0.5 * (lp - ref) ** 2,
    "k3": lambda lp, ref: max(-10.0, min(10.0, math.exp(ref - lp) - (ref - lp) - 1)),
}
ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


@pytest.mark.parametrize("kind", list(FORMULAS) + list(ALIASES))
def test_estimators_match_formula(kind):
    torch.manual_seed(0)
    lp = -torch.rand(4, 6, dtype=torch.float64) * 5
    ref = -torch.rand(4, 6, dtype=torch.float64) * 5
    got = kl_penalty(lp, ref, kind)
    f = FORMULAS[ALIASES.get(kind, kind)]
    for i in range(4):
        for j in range(6):
            assert got[i, j].item() == pytest.approx(f(lp[i, j].item(), ref[i, j].item()), abs=1e-12)


def test_k3_is_clamped_and_nonnegative():
    lp = torch.tensor([0.0, 0.0, -30.0, -1.0, 0.0])
    ref = torch.tensor([30.0, -30.0, 0.0, -1.0, -5.0])
    k3 = kl_penalty(lp, ref, "low_var_kl")
    assert k3.tolist()[:3] == [10.0, 10.0, 10.0]
    assert k3[3].item() == 0.0
    assert k3[4].item() == pytest.approx(math.exp(-5) + 4, rel=1e-6)  # inside the clamp: exact
    assert (kl_penalty(torch.randn(100), torch.randn(100), "k3") >= 0).all()


def test_k3_plus_value_of_k3_gradient_of_k2():
    torch.manual_seed(1)
    ref = torch.randn(10)
    a = torch.randn(10, requires_grad=True)
    b = a.detach().clone().requires_grad_(True)
    v = kl_penalty(a, ref, "k3+")
    assert torch.allclose(v, kl_penalty(a.detach(), ref, "k3"))
    v.sum().backward()
    kl_penalty(b, ref, "k2").sum().backward()
    assert torch.allclose(a.grad, b.grad)


def test_unknown_and_shape_errors():
    with pytest.raises(KeyError, match="low_var_kl"):
        kl_penalty(torch.zeros(2), torch.zeros(2), "k4")
    with pytest.raises(ValueError, match="differ"):
        kl_penalty(torch.zeros(2), torch.zeros(3), "kl")
    assert {"k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"} <= set(KL_ESTIMATORS)
