"""Online DPO's pairing: the best and the worst response of each prompt, first one on ties, tied groups counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.algorithms.preference_pairs import best_worst_pairs


def test_best_and_worst_of_each_group_and_ties_counted() -> None:
    scores = torch.tensor([0.0, 1.0, 0.5, 1.0,   # a: best 1 (first of two 1.0), worst 0
                           0.3, 0.3, 0.3, 0.3,   # b: all equal → skipped
                           0.2, -1.0, 0.9, -1.0,  # c: best 10, worst 9 (first of two -1.0)
                           0.7])                 # d: a single response → no pair
    uid = np.array(["a"] * 4 + ["b"] * 4 + ["c"] * 4 + ["d"], dtype=object)
    p = best_worst_pairs(scores, uid)
    assert p.chosen_P.tolist() == [1, 10] and p.rejected_P.tolist() == [0, 9]
    assert (p.num_groups, p.tied_groups, p.num_pairs) == (4, 2, 2)
    assert p.interleaved().tolist() == [1, 0, 10, 9]


def test_groups_need_not_be_contiguous_and_tolerance_applies() -> None:
    scores = torch.tensor([1.0, 2.0, 1.0005, 5.0])
    uid = ["x", "y", "x", "y"]
    assert best_worst_pairs(scores, uid).chosen_P.tolist() == [2, 3]
    tol = best_worst_pairs(scores, uid, atol=1e-3)
    assert tol.tied_groups == 1 and tol.chosen_P.tolist() == [3] and tol.rejected_P.tolist() == [1]


def test_all_tied_gives_no_pairs_and_bad_shapes_fail() -> None:
    p = best_worst_pairs(torch.ones(4), ["a", "a", "b", "b"])
    assert p.num_pairs == 0 and p.tied_groups == 2 and p.interleaved().tolist() == []
    with pytest.raises(ValueError, match="one value per response"):
        best_worst_pairs(torch.ones(4, 2), ["a"] * 4)
