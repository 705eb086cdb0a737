"""StatefulDataLoader: deterministic order, resume mid-epoch and at the epoch boundary, workers == no workers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.config import load_config
from hybridflow.data import RLHFDataset, StatefulDataLoader, build_rl_datasets, make_dataloader, task_splits
from hybridflow.models.tokenizer import builtin_tokenizer

TOK = builtin_tokenizer()


@pytest.fixture(scope="module")
def ds() -> RLHFDataset:
    train, _ = task_splits("arithmetic", 22, 4, seed=3)
    return RLHFDataset(train, TOK, max_prompt_length=64)


def _indices(batches) -> list[list[int]]:
    return [list(b.non_tensor_batch["index"]) for b in batches]


def _epochs(loader: StatefulDataLoader, n: int) -> list[list[int]]:
    return [idx for _ in range(n) for idx in _indices(loader)]


def test_len_drop_last_and_shuffle_is_a_seeded_permutation(ds):
    assert len(StatefulDataLoader(ds, 5, drop_last=True)) == 4
    assert len(StatefulDataLoader(ds, 5, drop_last=False)) == 5
    a = _indices(StatefulDataLoader(ds, 5, seed=7, drop_last=False))
    b = _indices(StatefulDataLoader(ds, 5, seed=7, drop_last=False))
    c = _indices(StatefulDataLoader(ds, 5, seed=8, drop_last=False))
    assert a == b and a != c
    assert sorted(i for batch in a for i in batch) == list(range(22))  # a permutation, the last batch short
    assert [len(x) for x in a] == [5, 5, 5, 5, 2]
    assert _indices(StatefulDataLoader(ds, 5, shuffle=False, drop_last=False))[0] == [0, 1, 2, 3, 4]


def test_epochs_differ_and_uids_carry_the_epoch(ds):
    loader = StatefulDataLoader(ds, 11, seed=1)
    e0, e1 = list(loader), list(loader)
    assert _indices(e0) != _indices(e1)
    assert e1[0].non_tensor_batch["uid"][0] == f"train-e1-{e1[0].non_tensor_batch['index'][0]}"
    assert len(set(e0[0].non_tensor_batch["uid"])) == 11


def _resume_sequence(ds, stop_after: int, total_epochs: int = 3) -> tuple[list[list[int]], list[list[int]]]:
    """Reference: one uninterrupted run. Resumed: stop after `stop_after` batches, save, restore in a new loader."""
    reference = _epochs(StatefulDataLoader(ds, 4, seed=5), total_epochs)
    first = StatefulDataLoader(ds, 4, seed=5)
    seen: list[list[int]] = []
    while len(seen) < stop_after:
        for batch in first:
            seen.append(list(batch.non_tensor_batch["index"]))
            if len(seen) == stop_after:
                break
    state = first.state_dict()
    resumed = StatefulDataLoader(ds, 4, seed=5)
    resumed.load_state_dict(state)
    while len(seen) < len(reference):
        seen.extend(_indices(resumed))
    return reference, seen


@pytest.mark.parametrize("stop_after", [1, 3, 5, 7])
def test_resume_mid_epoch_continues_with_next_unseen_batch(ds, stop_after):
    reference, seen = _resume_sequence(ds, stop_after)
    assert seen == reference


@pytest.mark.parametrize("stop_after", [5, 10])  # 5 batches per epoch: exactly at the boundary
def test_resume_at_epoch_boundary(ds, stop_after):
    reference, seen = _resume_sequence(ds, stop_after)
    assert seen == reference


def test_state_after_a_completed_epoch_points_at_the_next_one(ds):
    loader = StatefulDataLoader(ds, 4, seed=5)
    list(loader)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["batch_in_epoch"] == 0


def test_prefetching_workers_do_not_advance_the_state(ds):
    loader = StatefulDataLoader(ds, 4, seed=5, num_workers=2, prefetch_factor=2)
    it = iter(loader)
    next(it)
    assert loader.state_dict()["batch_in_epoch"] == 1


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.batch.keys() == y.batch.keys()
        for k in x.batch:
            assert torch.equal(x.batch[k], y.batch[k]), k
        for k in x.non_tensor_batch:
            assert list(x.non_tensor_batch[k]) == list(y.non_tensor_batch[k]), k


def test_num_workers_0_and_2_give_identical_batches(ds):
    cfg0 = load_config([], ["data.num_workers=0"]).data
    cfg2 = load_config([], ["data.num_workers=2", "data.prefetch_factor=2", "data.persistent_workers=true"]).data
    l0 = make_dataloader(ds, cfg0, 4, shuffle=True, drop_last=False)
    l2 = make_dataloader(ds, cfg2, 4, shuffle=True, drop_last=False)
    for _ in range(2):  # two epochs: persistent workers are reused for the second
        _assert_same(list(l0), list(l2))


def test_build_rl_datasets_from_task_and_whole_set_validation():
    cfg = load_config([], ["data.task=sort", "data.train_size=40", "data.val_size=8"]).data
    train, val = build_rl_datasets(cfg, TOK)
    assert len(train) == 40 and len(val) == 8
    loader = make_dataloader(val, cfg, None, shuffle=False, drop_last=False)
    batches = list(loader)
    assert len(loader) == 1 and len(batches[0]) == 8
    assert set(batches[0].non_tensor_batch["data_source"]) == {"hybridflow/sort"}
    ids, mask = batches[0].batch["input_ids"], batches[0].batch["attention_mask"]
    assert torch.equal(batches[0].batch["position_ids"], (mask.cumsum(-1) - 1).clamp(min=0))
    assert np.all(ids[mask == 0].numpy() == TOK.pad_token_id)


def test_too_large_batch_with_drop_last_is_a_clear_error(ds):
    with pytest.raises(ValueError, match="drop_last"):
        StatefulDataLoader(ds, 100, drop_last=True)


def test_abandoned_iteration_with_persistent_workers_continues_where_it_stopped(ds):
    reference = _indices(StatefulDataLoader(ds, 3, seed=2))
    loader = StatefulDataLoader(ds, 3, seed=2, num_workers=2, prefetch_factor=2, persistent_workers=True)
    seen = []
    for batch in loader:  # stop early while the workers have prefetched more
        seen.append(list(batch.non_tensor_batch["index"]))
        if len(seen) == 2:
            break
    seen.extend(_indices(loader))
    assert seen == reference
