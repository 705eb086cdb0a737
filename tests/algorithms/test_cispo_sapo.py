"""CISPO and SAPO against per-token references written from the papers' formulas (plain Python floats), on fixed
random inputs: loss values and the gradients with respect to the current log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.algorithms.policy_loss import POLICY_LOSSES, vanilla_policy_loss


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, t = 4, 7
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3 - 0.05
    new = (old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.4).requires_grad_(True)
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).contiguous()
    mask = torch.ones(b, t, dtype=torch.float64)
    mask[0, 5:] = 0
    mask[2, 3:] = 0
    return old, new, adv, mask


def _cells(mask):
    return [(i, j) for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j] > 0]


def test_cispo_matches_the_paper_per_token():
    """L = -mean_t sg(min(r_t, 1+εh)) · A_t · log π_t; ∂L/∂log π_t = -min(r_t, 1+εh) · A_t / N (the paper's runs set
    no lower bound: `clip_ratio_low` is ignored)."""
    old, new, adv, mask = _inputs()
    low, high = 0.2, 0.28
    loss, metrics = POLICY_LOSSES.get("cispo")(old, new, adv, mask, clip_ratio_low=low, clip_ratio_high=high,
                                               loss_agg_mode="token-mean")
    loss.backward()
    cells = _cells(mask)
    n = len(cells)
    ref_loss, clipped = 0.0, 0
    for i, j in cells:
        r = math.exp(new[i, j].item() - old[i, j].item())
        w = min(r, 1 + high)
        clipped += w != r
        ref_loss += -w * adv[i, j].item() * new[i, j].item() / n
        assert new.grad[i, j].item() == pytest.approx(-w * adv[i, j].item() / n, rel=1e-12, abs=1e-15)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12)
    assert metrics["pg_clipfrac"].item() == pytest.approx(clipped / n)
    assert 0 < clipped < n  # the inputs exercise both clipped and unclipped tokens
    assert (torch.exp(new - old)[mask > 0] < 1 - low).any()  # ... and ratios under the (ignored) lower bound
    assert metrics["pg_clipfrac_lower"].item() == 0.0
    for i, j in [(0, 6), (2, 4)]:  # masked tokens get no gradient
        assert new.grad[i, j].item() == 0.0


def test_cispo_keeps_a_gradient_where_ppo_clips_it_to_zero():
    old = torch.zeros(1, 1, dtype=torch.float64)
    new = torch.full((1, 1), math.log(2.0), dtype=torch.float64, requires_grad=True)  # ratio 2 > 1.2
    adv, mask = torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64)
    vanilla_policy_loss(old, new, adv, mask, clip_ratio_c=None)[0].backward()
    assert new.grad.item() == 0.0
    new.grad = None
    POLICY_LOSSES.get("cispo")(old, new, adv, mask)[0].backward()
    assert new.grad.item() == pytest.approx(-1.2)


def test_cispo_puts_no_floor_under_a_falling_ratio():
    """A token the update already pushed down (A < 0, r = 0.5) keeps its weight r; a floor at 1 - clip_ratio_low
    (0.8) pushed it down harder and slowed learning off-policy (docs/benchmarks.md, "CISPO and SAPO")."""
    old = torch.zeros(1, 1, dtype=torch.float64)
    new = torch.full((1, 1), math.log(0.5), dtype=torch.float64, requires_grad=True)
    adv, mask = -torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64)
    POLICY_LOSSES.get("cispo")(old, new, adv, mask, clip_ratio_low=0.2)[0].backward()
    assert new.grad.item() == pytest.approx(0.5)


def test_sapo_matches_the_paper_per_token():
    """L = -mean_t f(r_t) · A_t, f(r) = 4/τ · σ(τ(r - 1)), τ = τ_pos if A > 0 else τ_neg;
    ∂L/∂log π_t = -A_t · 4 σ(1 - σ) · r_t / N."""
    old, new, adv, mask = _inputs(1)
    tau_pos, tau_neg = 1.0, 1.05
    loss, _ = POLICY_LOSSES.get("sapo")(old, new, adv, mask, tau_pos=tau_pos, tau_neg=tau_neg,
                                        loss_agg_mode="token-mean")
    loss.backward()
    cells = _cells(mask)
    n = len(cells)
    ref_loss = 0.0
    for i, j in cells:
        r = math.exp(new[i, j].item() - old[i, j].item())
        a = adv[i, j].item()
        tau = tau_pos if a > 0 else tau_neg
        s = 1 / (1 + math.exp(-tau * (r - 1)))
        ref_loss += -(4 / tau) * s * a / n
        assert new.grad[i, j].item() == pytest.approx(-a * 4 * s * (1 - s) * r / n, rel=1e-10)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12)


def test_sapo_on_policy_gradient_equals_ppo_and_fades_off_policy():
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    old = torch.zeros(1, 2, dtype=torch.float64)
    grads = {}
    for name in ("vanilla", "sapo"):
        new = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
        POLICY_LOSSES.get(name)(old, new, adv, mask)[0].backward()
        grads[name] = new.grad.clone()
    torch.testing.assert_close(grads["sapo"], grads["vanilla"])  # r = 1: -A / N for both
    far = torch.full((1, 2), math.log(10.0), dtype=torch.float64, requires_grad=True)  # r = 10
    POLICY_LOSSES.get("sapo")(old, far, adv, mask)[0].backward()
    assert (far.grad.abs() < grads["sapo"].abs() * 0.5).all()  # soft trust region: smaller, not zero
    assert (far.grad.abs() > 0).all()
    with pytest.raises(ValueError, match="tau_pos"):
        POLICY_LOSSES.get("sapo")(old, far, adv, mask, tau_pos=0.0)


def test_the_actor_loss_hands_sapo_its_temperatures_from_the_config():
    from hybridflow.config import load_config
    from hybridflow.workers.losses import make_actor_loss

    cfg = load_config(overrides=["actor.policy_loss=sapo", "actor.tau_pos=0.5", "actor.tau_neg=2.0"]).actor
    assert make_actor_loss(cfg, 8, False).loss_params == {"tau_pos": 0.5, "tau_neg": 2.0}
    vanilla = load_config(overrides=["actor.policy_loss=cispo"]).actor
    assert make_actor_loss(vanilla, 8, False).loss_params == {}  # losses without the parameters get none


def test_strictly_on_policy_every_loss_gives_the_vanilla_gradient():
    """Ratio 1 (the update's own log-probs as the old ones): CISPO, SAPO and PPO's clip coincide, so on the
    strictly on-policy quickstart they learn identically; they differ only off-policy."""
    _, new, adv, mask = _inputs(2)
    grads = {}
    for name in ("vanilla", "cispo", "sapo"):
        x = new.detach().clone().requires_grad_(True)
        POLICY_LOSSES.get(name)(x.detach(), x, adv, mask, loss_agg_mode="token-mean")[0].backward()
        grads[name] = x.grad
    torch.testing.assert_close(grads["cispo"], grads["vanilla"], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grads["sapo"], grads["vanilla"], rtol=1e-12, atol=1e-15)
