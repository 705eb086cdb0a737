"""Advantage estimators against naive per-row Python loops: ragged masks, holes, size-1 groups, ties."""

import math
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridflow.algorithms import ADVANTAGE_ESTIMATORS, compute_advantage


def valid_positions(mask_row):
    return [t for t, v in enumerate(mask_row) if v]


def naive_whiten(mat, mask):
    vals = [mat[i][t] for i in range(len(mat)) for t in valid_positions(mask[i])]
    n = len(vals)
    mean = sum(vals) / n if n else 0.0
    var = sum((v - mean) ** 2 for v in vals) / (n - 1) if n > 1 else 0.0
    return [
        [(mat[i][t] - mean) / math.sqrt(var + 1e-8) if mask[i][t] else 0.0 for t in range(len(mat[i]))]
        for i in range(len(mat))
    ]


def naive_gae(rewards, values, mask, gamma, lam):
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for i in range(B):
        pos = valid_positions(mask[i])
        last = 0.0
        for j in reversed(range(len(pos))):
            t = pos[j]
            next_v = values[i][pos[j + 1]] if j + 1 < len(pos) else 0.0
            delta = rewards[i][t] + gamma * next_v - values[i][t]
            last = delta + gamma * lam * last
            adv[i][t] = last
            ret[i][t] = last + values[i][t]
    return naive_whiten(adv, mask), ret


def naive_scores(rewards, mask):
    return [sum(r for r, m in zip(rr, mm) if m) for rr, mm in zip(rewards, mask)]


def naive_groups(index):
    groups = defaultdict(list)
    for i, uid in enumerate(index):
        groups[uid].append(i)
    return groups


def naive_grpo(rewards, mask, index, norm_by_std):
    scores = naive_scores(rewards, mask)
    adv = [0.0] * len(scores)
    for rows in naive_groups(index).values():
        if len(rows) < 2:
            continue
        xs = [scores[i] for i in rows]
        mean = sum(xs) / len(xs)
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
        for i in rows:
            adv[i] = (scores[i] - mean) / (std + 1e-6) if norm_by_std else scores[i] - mean
    return [[adv[i] if m else 0.0 for m in mask[i]] for i in range(len(mask))]


def naive_rloo(rewards, mask, index):
    scores = naive_scores(rewards, mask)
    adv = [0.0] * len(scores)
    for rows in naive_groups(index).values():
        for i in rows:
            others = [scores[j] for j in rows if j != i]
            adv[i] = scores[i] - sum(others) / len(others) if others else 0.0
    return [[adv[i] if m else 0.0 for m in mask[i]] for i in range(len(mask))]


def naive_returns(rewards, mask, gamma):
    out = []
    for rr, mm in zip(rewards, mask):
        row = [0.0] * len(rr)
        run = 0.0
        for t in reversed(valid_positions(mm)):
            run = rr[t] + gamma * run
            row[t] = run
        out.append(row)
    return out


def naive_rpp_baseline(rewards, mask, index):
    scores = naive_scores(rewards, mask)
    centred = [0.0] * len(scores)
    for rows in naive_groups(index).values():
        mean = sum(scores[i] for i in rows) / len(rows)
        for i in rows:
            centred[i] = scores[i] - mean
    mat = [[centred[i] if m else 0.0 for m in mask[i]] for i in range(len(mask))]
    return naive_whiten(mat, mask)


def make_batch(seed, B=12, T=9, holes=False, group_size=3):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    if holes:
        mask = mask * (torch.rand(B, T, generator=g) > 0.3).float()
    rewards = torch.randn(B, T, generator=g) * mask
    values = torch.randn(B, T, generator=g)
    # ragged groups: sizes group_size, …, and a singleton at the end
    index = np.array([f"p{i // group_size}" for i in range(B - 1)] + ["solo"], dtype=object)
    return rewards, mask, values, index


def close(got, ref, atol=1e-4):
    assert torch.allclose(got.double(), torch.tensor(ref, dtype=torch.float64), atol=atol), (got, ref)


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae(holes, gamma, lam):
    r, m, v, _ = make_batch(0, holes=holes)
    adv, ret = compute_advantage("gae", token_level_rewards=r, response_mask=m, values=v, gamma=gamma, lam=lam)
    ref_adv, ref_ret = naive_gae(r.tolist(), v.tolist(), m.tolist(), gamma, lam)
    close(adv, ref_adv)
    close(ret, ref_ret)


def test_gae_needs_values():
    r, m, _, _ = make_batch(0)
    with pytest.raises(ValueError, match="values"):
        compute_advantage("gae", token_level_rewards=r, response_mask=m, values=None)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo(norm):
    r, m, _, idx = make_batch(1)
    adv, ret = compute_advantage("grpo", token_level_rewards=r, response_mask=m, index=idx, norm_adv_by_std=norm)
    close(adv, naive_grpo(r.tolist(), m.tolist(), idx, norm))
    assert torch.equal(adv, ret)
    assert (adv[-1] == 0).all()  # singleton group


def test_grpo_all_equal_and_singletons_are_zero_not_nan():
    B, T = 6, 4
    m = torch.ones(B, T)
    r = torch.zeros(B, T)
    r[:, -1] = 1.0
    for idx in (np.array(["a"] * 3 + ["b"] * 3, dtype=object), np.arange(B)):
        for name in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
            adv, _ = compute_advantage(name, token_level_rewards=r, response_mask=m, index=idx)
            assert not torch.isnan(adv).any(), name
            assert (adv == 0).all(), name


def test_rloo():
    r, m, _, idx = make_batch(2)
    adv, _ = compute_advantage("rloo", token_level_rewards=r, response_mask=m, index=idx)
    close(adv, naive_rloo(r.tolist(), m.tolist(), idx))


@pytest.mark.parametrize("holes", [False, True])
def test_reinforce_plus_plus(holes):
    r, m, _, _ = make_batch(3, holes=holes)
    adv, ret = compute_advantage("reinforce_plus_plus", token_level_rewards=r, response_mask=m, gamma=0.9)
    ref_ret = naive_returns(r.tolist(), m.tolist(), 0.9)
    close(ret, ref_ret)
    close(adv, naive_whiten(ref_ret, m.tolist()))


def test_reinforce_plus_plus_baseline():
    r, m, _, idx = make_batch(4)
    adv, _ = compute_advantage("reinforce_plus_plus_baseline", token_level_rewards=r, response_mask=m, index=idx)
    close(adv, naive_rpp_baseline(r.tolist(), m.tolist(), idx))


def test_remax():
    r, m, _, _ = make_batch(5)
    base = torch.randn(r.shape[0])
    adv, ret = compute_advantage("remax", token_level_rewards=r, response_mask=m, baseline_rewards=base)
    ref_ret = naive_returns(r.tolist(), m.tolist(), 1.0)
    close(ret, ref_ret)
    ref_adv = [[(ref_ret[i][t] - base[i].item()) if m[i, t] else 0.0 for t in range(r.shape[1])] for i in range(len(r))]
    close(adv, ref_adv)
    with pytest.raises(ValueError, match="baseline_rewards"):
        compute_advantage("remax", token_level_rewards=r, response_mask=m)


def test_uniform_kwargs_accepted_by_every_estimator():
    r, m, v, idx = make_batch(6)
    kw = dict(
        token_level_rewards=r, response_mask=m, index=idx, values=v, gamma=1.0, lam=0.95,
        norm_adv_by_std=True, baseline_rewards=torch.zeros(len(r)), unused_extra="ignored",
    )
    for name in ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"):
        adv, ret = compute_advantage(name, **kw)
        assert adv.shape == ret.shape == r.shape
        assert torch.isfinite(adv).all() and (adv[m == 0] == 0).all(), name


def test_group_estimators_need_index():
    r, m, _, _ = make_batch(0)
    with pytest.raises(ValueError, match="index"):
        compute_advantage("grpo", token_level_rewards=r, response_mask=m)


def test_unknown_name_lists_registered():
    with pytest.raises(KeyError) as e:
        compute_advantage("gpro", token_level_rewards=torch.zeros(1, 1), response_mask=torch.ones(1, 1))
    msg = str(e.value)
    assert "grpo" in msg and "gae" in msg and "rloo" in msg and "remax" in msg


def test_register_custom_estimator_in_a_few_lines():
    @ADVANTAGE_ESTIMATORS.register("test_sign", override=True)
    def sign_adv(*, token_level_rewards, response_mask, **_):
        adv = torch.sign(token_level_rewards.sum(-1, keepdim=True)) * response_mask
        return adv, adv

    r, m, _, _ = make_batch(7)
    adv, _ = compute_advantage("test_sign", token_level_rewards=r, response_mask=m, gamma=1.0)
    assert torch.equal(adv, torch.sign(r.sum(-1, keepdim=True)) * m)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_hypothesis_shapes_and_masks(data):
    B = data.draw(st.integers(1, 7))
    T = data.draw(st.integers(1, 8))
    mask = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=T, max_size=T), min_size=B, max_size=B)))
    index = np.array(data.draw(st.lists(st.integers(0, 2), min_size=B, max_size=B)))
    seed = data.draw(st.integers(0, 10_000))
    g = torch.Generator().manual_seed(seed)
    m = mask.float()
    r = torch.randn(B, T, generator=g) * m
    v = torch.randn(B, T, generator=g)
    adv, ret = compute_advantage("gae", token_level_rewards=r, response_mask=m, values=v, gamma=0.97, lam=0.9)
    ref_adv, ref_ret = naive_gae(r.tolist(), v.tolist(), m.tolist(), 0.97, 0.9)
    close(adv, ref_adv, atol=2e-3)
    close(ret, ref_ret)
    norm = data.draw(st.booleans())
    adv, _ = compute_advantage("grpo", token_level_rewards=r, response_mask=m, index=index, norm_adv_by_std=norm)
    close(adv, naive_grpo(r.tolist(), m.tolist(), index, norm), atol=2e-3)
    adv, _ = compute_advantage("rloo", token_level_rewards=r, response_mask=m, index=index)
    close(adv, naive_rloo(r.tolist(), m.tolist(), index))
