import random

import pytest

from hybridflow.engine.micro_batch import balanced_partition, fixed_micro_batches, token_budget_micro_batches


def test_fixed_micro_batches_cover_in_order():
    assert fixed_micro_batches(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    with pytest.raises(ValueError):
        fixed_micro_batches(4, 0)


def test_token_budget_respected_minimal_and_balanced():
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(1, 100) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(100, 400)
        parts = token_budget_micro_batches(lengths, budget)
        assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
        loads = [sum(lengths[i] for i in p) for p in parts]
        assert max(loads) <= budget and all(p for p in parts)
        assert len(parts) >= -(-sum(lengths) // budget)
        # Near-minimal: one fewer micro-batch cannot hold the tokens, or the greedy split was over budget.
        if len(parts) > 1:
            fewer = balanced_partition(lengths, len(parts) - 1)
            assert max(sum(lengths[i] for i in p) for p in fewer) > budget


def test_balanced_partition_beats_contiguous_split():
    lengths = [100, 1, 1, 1, 100, 1, 1, 1]
    loads = sorted(sum(lengths[i] for i in p) for p in balanced_partition(lengths, 2))
    assert loads == [103, 103]


def test_too_long_sequence_names_the_fix():
    with pytest.raises(ValueError, match="max_token_len_per_gpu"):
        token_budget_micro_batches([10, 500], 100)
