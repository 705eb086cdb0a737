"""Fixed/adaptive KL controllers (exact Ziegler update), config building, state round-trip, KL-in-reward."""

import pytest
import torch

from hybridflow.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
)
from hybridflow.config.schema import KLCtrlConfig


def test_fixed_never_moves():
    c = FixedKLController(0.05)
    for kl in (0.0, 1.0, 100.0):
        c.update(kl, 256)
    assert c.value == 0.05


def test_adaptive_exact_formula_up_and_down():
    c = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.02, horizon=1000)
    expected = 0.1
    for kl, n in [(0.03, 64), (0.5, 64), (0.01, 128), (0.0, 32), (0.021, 10)]:
        err = min(max(kl / 0.02 - 1, -0.2), 0.2)
        before = c.value
        c.update(kl, n)
        expected *= 1 + err * n / 1000
        assert c.value == pytest.approx(expected, rel=1e-12)
        assert (c.value > before) == (kl > 0.02)
    # the ±0.2 clip: a huge KL moves exactly as much as kl = 1.2 · target
    a, b = AdaptiveKLController(1.0, 0.1, 100), AdaptiveKLController(1.0, 0.1, 100)
    a.update(50.0, 10)
    b.update(0.12, 10)
    assert a.value == pytest.approx(b.value) == pytest.approx(1.02)


@pytest.mark.parametrize("kind", ["adaptive", "kl_controller"])
def test_build_adaptive_from_config(kind):
    c = build_kl_controller(KLCtrlConfig(type=kind, kl_coef=0.2, target_kl=0.05, horizon=500))
    assert isinstance(c, AdaptiveKLController)
    assert (c.value, c.target, c.horizon) == (0.2, 0.05, 500)
    fixed = build_kl_controller(KLCtrlConfig(type="fixed", kl_coef=0.3, target_kl=0.1, horizon=10))
    assert type(fixed) is FixedKLController and fixed.value == 0.3


def test_build_takes_the_config_section_only():
    """One type: the `algorithm.kl_ctrl` section, never a mapping with defaults filled in behind its back."""
    with pytest.raises(AttributeError):
        build_kl_controller({"type": "fixed", "kl_coef": 0.3})


def test_build_errors_name_the_key():
    with pytest.raises(ValueError, match="algorithm.kl_ctrl.type"):
        KLCtrlConfig(type="pid", kl_coef=0.1, target_kl=0.1, horizon=10)
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, target_kl=0.0, horizon=10)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, target_kl=0.1, horizon=0)


def test_state_dict_round_trip():
    c = AdaptiveKLController(0.1, 0.01, 100)
    c.update(1.0, 50)
    state = c.state_dict()
    d = AdaptiveKLController(0.1, 0.01, 100)
    d.load_state_dict(state)
    assert d.value == c.value != 0.1
    with pytest.raises(ValueError, match="adaptive"):
        FixedKLController(0.1).load_state_dict(state)


def test_apply_kl_penalty_matches_naive_and_updates_controller():
    torch.manual_seed(0)
    B, T = 5, 6
    lengths = torch.tensor([6, 3, 1, 4, 6])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    scores = torch.zeros(B, T)
    scores[torch.arange(B), lengths - 1] = torch.randn(B)
    old = -torch.rand(B, T) * 2
    ref = -torch.rand(B, T) * 2
    ctrl = AdaptiveKLController(0.1, 0.05, 1000)
    rewards, met = apply_kl_penalty(scores, old, ref, mask, ctrl, "kl")
    seq_kl = []
    for i in range(B):
        kls = []
        for t in range(T):
            kl = (old[i, t] - ref[i, t]).item() if mask[i, t] else 0.0
            assert rewards[i, t].item() == pytest.approx(scores[i, t].item() - 0.1 * kl, abs=1e-6)
            if mask[i, t]:
                kls.append(kl)
        seq_kl.append(sum(kls) / len(kls))
    batch_kl = sum(seq_kl) / B
    assert met["actor/reward_kl_penalty"] == pytest.approx(batch_kl, abs=1e-6)
    assert met["actor/reward_kl_penalty_coeff"] == 0.1
    err = min(max(batch_kl / 0.05 - 1, -0.2), 0.2)
    assert ctrl.value == pytest.approx(0.1 * (1 + err * B / 1000), rel=1e-6)
