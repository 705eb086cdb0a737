"""DAPO overlong shaping and the dynamic-sampling filter against naive references."""

from collections import defaultdict

import numpy as np
import pytest
import torch

from hybridflow.algorithms import filter_uninformative_groups, overlong_penalty


def test_overlong_penalty_piecewise():
    lengths = torch.arange(0, 21)
    got = overlong_penalty(lengths, max_response_length=20, overlong_buffer_len=8, overlong_penalty_factor=0.5)
    for L, p in zip(lengths.tolist(), got.tolist()):
        ref = 0.0 if L <= 12 else -(L - 12) / 8 * 0.5
        assert p == pytest.approx(ref)
    assert got[-1].item() == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_penalty(lengths, 20, 0, 1.0)
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_penalty(lengths, 20, 21, 1.0)


def naive_filter(rewards, index, keep_singletons):
    groups = defaultdict(list)
    for i, u in enumerate(index):
        groups[u].append(i)
    keep = [True] * len(rewards)
    dropped = 0
    for rows in groups.values():
        flat = len({rewards[i] for i in rows}) == 1
        if flat and (len(rows) > 1 or not keep_singletons):
            dropped += 1
            for i in rows:
                keep[i] = False
    return keep, dropped / len(groups)


@pytest.mark.parametrize("keep_singletons", [True, False])
def test_filter_matches_naive(keep_singletons):
    rng = np.random.default_rng(0)
    index = np.array(["a"] * 4 + ["b"] * 4 + ["c"] * 3 + ["d"] + ["e"] * 2, dtype=object)
    rewards = rng.integers(0, 2, len(index)).astype(float)
    rewards[:4] = 1.0  # all-correct group
    rewards[4:8] = [0, 1, 0, 0]
    rewards[12:14] = 0.0  # all-wrong group
    keep, frac = filter_uninformative_groups(torch.tensor(rewards), index, keep_singletons=keep_singletons)
    ref_keep, ref_frac = naive_filter(rewards.tolist(), index, keep_singletons)
    assert keep.tolist() == ref_keep
    assert frac == pytest.approx(ref_frac)
    assert not keep[:4].any() and keep[4:8].all()


def test_filter_empty_and_shape_error():
    keep, frac = filter_uninformative_groups(torch.zeros(0), np.array([]))
    assert keep.numel() == 0 and frac == 0.0
    with pytest.raises(ValueError, match="one score per response"):
        filter_uninformative_groups(torch.zeros(2, 2), np.array([0, 1]))
