"""PPO clip (asymmetric, dual-clip) and GSPO against naive loops, plus the gradient properties."""

import math

import pytest
import torch

from hybridflow.algorithms import POLICY_LOSSES, gspo_policy_loss, vanilla_policy_loss
from hybridflow.algorithms.aggregation import LOSS_AGG_MODES


def naive_ppo_token(old, new, adv, low, high, c):
    ratio = math.exp(new - old)
    l1 = -adv * ratio
    l2 = -adv * min(max(ratio, 1 - low), 1 + high)
    loss = max(l1, l2)
    clipped = l2 > l1
    lower = False
    if c is not None and adv < 0:
        lower = loss > -adv * c
        loss = min(loss, -adv * c)
    return loss, clipped, lower


def naive_agg(loss, mask, mode, max_len=None):
    rows = [[x for x, m in zip(lr, mr) if m] for lr, mr in zip(loss, mask)]
    nonempty = [r for r in rows if r]
    if mode == "token-mean":
        n = sum(len(r) for r in rows)
        return sum(sum(r) for r in rows) / n if n else 0.0
    if not nonempty:
        return 0.0
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in nonempty) / len(nonempty)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / len(nonempty)
    return sum(sum(r) / max_len for r in nonempty) / len(nonempty)


def batch(seed, B=6, T=7, spread=0.5):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    old = -torch.rand(B, T, generator=g) * 3
    new = old + torch.randn(B, T, generator=g) * spread
    adv = torch.randn(B, T, generator=g)
    return old, new, adv, mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("c", [3.0, None])
def test_vanilla_matches_naive(mode, c):
    old, new, adv, mask = batch(0, spread=1.0)
    low, high = 0.2, 0.28
    loss, met = vanilla_policy_loss(
        old, new, adv, mask, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c, loss_agg_mode=mode, max_len=10
    )
    tok = [[naive_ppo_token(o, n, a, low, high, c) for o, n, a in zip(ro, rn, ra)]
           for ro, rn, ra in zip(old.tolist(), new.tolist(), adv.tolist())]
    ref = naive_agg([[t[0] for t in r] for r in tok], mask.tolist(), mode, max_len=10)
    assert loss.item() == pytest.approx(ref, abs=1e-5)
    valid = [t for r, mr in zip(tok, mask.tolist()) for t, m in zip(r, mr) if m]
    assert float(met["pg_clipfrac"]) == pytest.approx(sum(t[1] for t in valid) / len(valid), abs=1e-6)
    assert float(met["pg_clipfrac_lower"]) == pytest.approx(sum(t[2] for t in valid) / len(valid), abs=1e-6)
    kl = [o - n for ro, rn, mr in zip(old.tolist(), new.tolist(), mask.tolist()) for o, n, m in zip(ro, rn, mr) if m]
    assert float(met["ppo_kl"]) == pytest.approx(sum(kl) / len(kl), abs=1e-6)
    if c is not None:
        assert float(met["pg_clipfrac_lower"]) > 0  # the spread makes dual-clip fire; the test exercises it


def test_zero_gradient_where_clipped():
    old = torch.zeros(1, 6)
    # ratios: 1.5 (A>0, clipped), 1.1 (A>0, inside), 0.5 (A<0, clipped), 0.9 (A<0, inside),
    #         0.5 (A>0, below range: not clipped), 1.5 (A<0, above range: not clipped, under dual-clip bound)
    ratios = torch.tensor([[1.5, 1.1, 0.5, 0.9, 0.5, 1.5]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0, -1.0]])
    new = ratios.log().requires_grad_(True)
    loss, met = vanilla_policy_loss(old, new, adv, torch.ones(1, 6), clip_ratio_low=0.2, clip_ratio_high=0.2)
    loss.backward()
    expected = -adv * ratios / 6  # d(-A·r)/d logp = -A·r, token-mean over 6
    expected[0, 0] = 0.0
    expected[0, 2] = 0.0
    assert torch.allclose(new.grad, expected, atol=1e-7)
    assert float(met["pg_clipfrac"]) == pytest.approx(2 / 6)


def test_dual_clip_bound_and_zero_gradient():
    torch.manual_seed(0)
    n = 64
    old = torch.zeros(1, n)
    new = (torch.randn(1, n) * 2).requires_grad_(True)
    adv = torch.randn(1, n)
    c = 3.0
    per_token = []
    for t in range(n):
        m = torch.zeros(1, n)
        m[0, t] = 1
        lt, _ = vanilla_policy_loss(old, new, adv, m, clip_ratio_c=c)
        per_token.append(lt)
    per_token = torch.stack(per_token)
    neg = adv[0] < 0
    assert (per_token[neg] <= -adv[0][neg] * c + 1e-6).all()
    assert (per_token[neg] >= 0).all()
    loss, _ = vanilla_policy_loss(old, new, adv, torch.ones(1, n), clip_ratio_c=c)
    loss.backward()
    capped = neg & (new.detach()[0].exp() > c)
    assert capped.any()
    assert (new.grad[0][capped] == 0).all()
    assert (new.grad[0][~capped & (new.detach()[0].exp() > 1.2) & neg] != 0).all()


def test_clip_args_validated():
    old, new, adv, mask = batch(0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        vanilla_policy_loss(old, new, adv, mask, clip_ratio_c=0.5)
    with pytest.raises(ValueError, match="clip_ratio_low"):
        vanilla_policy_loss(old, new, adv, mask, clip_ratio_low=1.5)


def test_gspo_ratio_is_exp_of_mean_token_log_ratio():
    old, new, _, mask = batch(1, spread=0.1)
    adv_seq = torch.randn(old.shape[0])
    adv = adv_seq[:, None] * mask
    loss, _ = gspo_policy_loss(old, new, adv, mask, clip_ratio_low=0.99, clip_ratio_high=100.0)
    ref, n = 0.0, 0
    for i in range(old.shape[0]):
        valid = [t for t in range(old.shape[1]) if mask[i, t]]
        if not valid:
            continue
        s = math.exp(sum(new[i, t].item() - old[i, t].item() for t in valid) / len(valid))
        ref += -adv_seq[i].item() * s
        n += 1
    assert loss.item() == pytest.approx(ref / n, abs=1e-6)


def test_gspo_gradient_equals_sequence_level_objective():
    old, new0, _, mask = batch(2, spread=0.05)
    adv_seq = torch.randn(old.shape[0])
    adv = adv_seq[:, None] * mask
    low, high = 0.015, 0.02  # tight, so some sequences clip
    a = new0.clone().requires_grad_(True)
    loss, met = gspo_policy_loss(old, a, adv, mask, clip_ratio_low=low, clip_ratio_high=high)
    loss.backward()
    b = new0.clone().requires_grad_(True)
    lengths = mask.sum(-1)
    nonempty = lengths > 0
    s = torch.exp(((b - old) * mask).sum(-1) / lengths.clamp(min=1))
    seq_loss = torch.maximum(-adv_seq * s, -adv_seq * s.clamp(1 - low, 1 + high))
    ref = seq_loss[nonempty].mean()
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), abs=1e-6)
    assert torch.allclose(a.grad, b.grad, atol=1e-6)
    clipped_seq = (s.detach() < 1 - low) | (s.detach() > 1 + high)
    assert clipped_seq[nonempty].any() and not clipped_seq[nonempty].all()
    assert float(met["pg_clipfrac"]) > 0


def test_registry_and_custom_loss():
    assert POLICY_LOSSES["ppo"] is POLICY_LOSSES["vanilla"]

    @POLICY_LOSSES.register("test_reinforce", override=True)
    def reinforce(old_log_prob, log_prob, advantages, response_mask, **_):
        loss = -(advantages * log_prob * response_mask).sum() / response_mask.sum()
        return loss, {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": 0.0}

    old, new, adv, mask = batch(3)
    loss, _ = POLICY_LOSSES["test_reinforce"](old, new, adv, mask, clip_ratio_low=0.2, loss_agg_mode="token-mean")
    assert torch.isfinite(loss)
    with pytest.raises(KeyError, match="vanilla"):
        POLICY_LOSSES["vanila"]
