"""Tests for hybridflow.protocol.DataProto against naive per-row references."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

from hybridflow.protocol import DataProto, DataProtoItem, pad_dataproto_to_divisor, unpad_dataproto


def make(n: int = 6, meta: dict | None = None) -> DataProto:
    """Rows i hold x = [i*4 .. i*4+3] (float), ids = i (int), s = f"s{i}", d = {"i": i}."""
    return DataProto.from_single_dict(
        {
            "x": torch.arange(n * 4, dtype=torch.float32).view(n, 4),
            "ids": torch.arange(n),
            "s": [f"s{i}" for i in range(n)],
            "d": [{"i": i} for i in range(n)],
        },
        meta_info=dict(meta or {"temperature": 1.0}),
    )


def row_ids(data: DataProto) -> list[int]:
    """The original row number of each row, read from every column (and checked to agree)."""
    ids = data.batch["ids"].tolist()
    assert data.batch["x"][:, 0].div(4).long().tolist() == ids
    assert list(data.non_tensor_batch["s"]) == [f"s{i}" for i in ids]
    assert [d["i"] for d in data.non_tensor_batch["d"]] == ids
    return ids


def shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# ------------------------------------------------------------------------------------------- construction
def test_mismatched_sizes_name_key_and_both_sizes() -> None:
    with pytest.raises(ValueError, match=r"batch\['b'\] has 3 rows but batch\['a'\] has 4 rows"):
        DataProto(batch={"a": torch.zeros(4), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"non_tensor_batch\['s'\] has 5 rows but batch\['a'\] has 4 rows"):
        DataProto.from_dict({"a": torch.zeros(4, 2)}, {"s": ["x"] * 5})


def test_construction_type_errors() -> None:
    with pytest.raises(TypeError, match=r"non_tensor_batch\['s'\] must be a numpy.ndarray.*dtype=object"):
        DataProto(non_tensor_batch={"s": ["a", "b"]})
    with pytest.raises(TypeError, match=r"batch\['a'\] must be a torch.Tensor"):
        DataProto(batch={"a": np.zeros(3)})
    with pytest.raises(ValueError, match=r"batch\['a'\] is 0-dimensional.*meta_info"):
        DataProto(batch={"a": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="'t' is a float"):
        DataProto.from_single_dict({"t": 0.5})


def test_from_dict_keeps_equal_length_lists_as_objects_and_accepts_none() -> None:
    data = DataProto.from_dict({"a": torch.zeros(2)}, {"l": [[1, 2], [3, 4]]})
    assert data.non_tensor_batch["l"].shape == (2,)
    assert data.non_tensor_batch["l"][1] == [3, 4]
    legacy = DataProto(batch=None, non_tensor_batch=None, meta_info=None)
    assert len(legacy) == 0 and legacy.batch == {} and legacy.meta_info == {}


def test_from_rows_stacks_tensors_and_collects_the_rest() -> None:
    rows = [{"t": torch.full((3,), float(i)), "s": f"r{i}", "n": None} for i in range(4)]
    data = DataProto.from_rows(rows, meta_info={"k": 1})
    assert torch.equal(data.batch["t"], torch.arange(4.0).unsqueeze(1).expand(4, 3))
    assert list(data.non_tensor_batch["s"]) == ["r0", "r1", "r2", "r3"]
    assert list(data.non_tensor_batch["n"]) == [None] * 4 and data.meta_info == {"k": 1}
    assert len(DataProto.from_rows([])) == 0
    with pytest.raises(ValueError, match="row 1 has keys"):
        DataProto.from_rows([{"a": 1}, {"b": 1}])
    with pytest.raises(ValueError, match="cannot stack the tensors of 't'"):
        DataProto.from_rows([{"t": torch.zeros(2)}, {"t": torch.zeros(3)}])
    with pytest.raises(TypeError, match="'t' mixes tensors"):
        DataProto.from_rows([{"t": torch.zeros(2)}, {"t": 1}])


def test_basics_len_keys_contains_repr_empty() -> None:
    data = make(6)
    assert len(data) == data.batch_size == 6
    assert data.keys() == ["x", "ids", "s", "d"]
    assert "x" in data and "s" in data and "temperature" not in data
    text = repr(DataProto.from_single_dict({"x": torch.empty(4096, 2048)}, meta_info={"m": 1}))
    assert text == "DataProto(len=4096, batch={x: float32[4096, 2048]}, non_tensor_batch={}, meta_info_keys=['m'])"
    assert len(DataProto.from_dict(non_tensors={"s": ["a", "b", "c"]})) == 3
    empty = DataProto.empty({"a": 1})
    assert len(empty) == 0 and empty.keys() == [] and empty.meta_info == {"a": 1}


# ----------------------------------------------------------------------------------------------- indexing
def test_int_index_gives_one_row() -> None:
    data = make(5)
    item = data[2]
    assert isinstance(item, DataProtoItem)
    assert item.batch["x"].tolist() == [8.0, 9.0, 10.0, 11.0] and int(item.batch["ids"]) == 2
    assert item.non_tensor_batch == {"s": "s2", "d": {"i": 2}}
    assert item.meta_info == {"temperature": 1.0}
    assert int(data[-1].batch["ids"]) == 4 and int(data[np.int64(1)].batch["ids"]) == 1
    assert int(data[torch.tensor(3)].batch["ids"]) == 3
    with pytest.raises(IndexError, match="index 5 is out of range for 5 rows"):
        data[5]
    with pytest.raises(TypeError, match="not a bool"):
        data[True]
    assert [int(r.batch["ids"]) for r in data] == [0, 1, 2, 3, 4]  # iteration via __getitem__


def test_slice_is_a_view_sharing_storage() -> None:
    data = make(8)
    view = data[2:6]
    assert isinstance(view, DataProto) and row_ids(view) == [2, 3, 4, 5]
    assert view.batch["x"].data_ptr() == data.batch["x"][2].data_ptr()
    assert np.shares_memory(view.non_tensor_batch["s"], data.non_tensor_batch["s"])
    view.batch["x"][0, 0] = -1.0  # writes through to the parent
    assert data.batch["x"][2, 0] == -1.0
    view.meta_info["new"] = 1  # meta_info is a shallow copy, not shared
    assert "new" not in data.meta_info
    stepped = data[1:8:3]
    assert stepped.batch["ids"].tolist() == [1, 4, 7] and shares(stepped.batch["ids"], data.batch["ids"])
    assert row_ids(make(8)[::-1]) == list(range(7, -1, -1))
    assert len(data[10:]) == 0


@pytest.mark.parametrize("index", [
    [4, 0, 4, -1],
    np.array([4, 0, 4, 5]),
    torch.tensor([4, 0, 4, 5]),
    range(4, 6),
])
def test_index_lists_gather_copies(index) -> None:
    data = make(6)
    expected = [i % 6 for i in list(index)]
    out = data[index]
    assert row_ids(out) == expected
    assert not shares(out.batch["x"], data.batch["x"])
    assert not np.shares_memory(out.non_tensor_batch["s"], data.non_tensor_batch["s"])


@pytest.mark.parametrize("to_mask", [list, np.array, torch.tensor])
def test_bool_mask_selects_rows(to_mask) -> None:
    data = make(6)
    keep = [True, False, False, True, True, False]
    out = data[to_mask(keep)]
    assert row_ids(out) == [0, 3, 4]
    assert row_ids(data.select_idxs(to_mask(keep))) == [0, 3, 4]
    with pytest.raises(ValueError, match="bool mask has length 2 but the DataProto has 6 rows"):
        data[to_mask([True, False])]


def test_bad_indices() -> None:
    data = make(3)
    with pytest.raises(IndexError, match="out of range for 3 rows"):
        data[[0, 3]]
    with pytest.raises(TypeError, match="integers or bools"):
        data[torch.tensor([0.0, 1.0])]
    with pytest.raises(ValueError, match="must be 1-D"):
        data[torch.zeros(2, 2, dtype=torch.long)]
    assert len(data[[]]) == 0


def test_reorder_in_place_and_select_idxs() -> None:
    data = make(5)
    assert row_ids(data.select_idxs([3, 1])) == [3, 1]
    assert data.reorder(torch.tensor([4, 3, 2, 1, 0])) is None
    assert row_ids(data) == [4, 3, 2, 1, 0]


# ---------------------------------------------------------------------------------------------------- keys
def test_select_shares_unless_deepcopy() -> None:
    data = make(4, meta={"a": [1], "b": 2})
    sub = data.select(batch_keys=["x"], non_tensor_batch_keys="s", meta_info_keys=["a"])
    assert sub.keys() == ["x", "s"] and sub.meta_info == {"a": [1]}
    assert sub.batch["x"] is data.batch["x"] and sub.non_tensor_batch["s"] is data.non_tensor_batch["s"]
    everything = data.select()
    assert everything.keys() == data.keys() and everything.meta_info == data.meta_info
    deep = data.select(batch_keys=["x"], non_tensor_batch_keys=["d"], meta_info_keys=["a"], deepcopy=True)
    deep.batch["x"][0, 0] = 100.0
    deep.non_tensor_batch["d"][0]["i"] = 100
    deep.meta_info["a"].append(3)
    assert data.batch["x"][0, 0] == 0.0 and data.non_tensor_batch["d"][0] == {"i": 0} and data.meta_info["a"] == [1]
    with pytest.raises(ValueError, match=r"batch has no key 'y'; available: \['ids', 'x'\]"):
        data.select(batch_keys=["y"])


def test_pop_removes_keys() -> None:
    data = make(4, meta={"a": 1, "b": 2})
    popped = data.pop(batch_keys=["x"], non_tensor_batch_keys=["s"], meta_info_keys=["a"])
    assert popped.keys() == ["x", "s"] and popped.meta_info == {"a": 1} and len(popped) == 4
    assert data.keys() == ["ids", "d"] and data.meta_info == {"b": 2}
    assert data.pop().keys() == [] and data.keys() == ["ids", "d"]
    with pytest.raises(ValueError, match="no key 'x'"):
        data.pop(batch_keys="x")


def test_union_adds_and_checks_conflicts() -> None:
    data = make(4)
    other = DataProto.from_dict({"y": torch.ones(4), "ids": torch.arange(4)}, {"t": list("abcd")}, {"k": 2})
    out = data.union(other)
    assert out is data and data.keys() == ["x", "ids", "y", "s", "d", "t"]
    assert data.meta_info == {"temperature": 1.0, "k": 2}
    with pytest.raises(ValueError, match=r"union: batch\['ids'\] differs"):
        make(4).union(DataProto(batch={"ids": torch.arange(4) + 1}))
    with pytest.raises(ValueError, match=r"union: batch\['ids'\] differs"):  # same values, other dtype
        make(4).union(DataProto(batch={"ids": torch.arange(4).float()}))
    with pytest.raises(ValueError, match=r"union: non_tensor_batch\['s'\] differs"):
        make(4).union(DataProto.from_dict(non_tensors={"s": list("abcd")}))
    with pytest.raises(ValueError, match=r"union: meta_info\['temperature'\] differs"):
        make(4).union(DataProto.empty({"temperature": 0.5}))
    with pytest.raises(ValueError, match=r"lengths differ \(4 vs 3 rows\)"):
        make(4).union(make(3))
    assert row_ids(DataProto.empty({"m": 1}).union(make(4))) == [0, 1, 2, 3]


def test_rename() -> None:
    data = make(3)
    assert data.rename("x", "features") is data
    data.rename(["s", "ids"], ["text", "index"])
    assert data.keys() == ["features", "index", "d", "text"]
    with pytest.raises(ValueError, match="would overwrite the existing column 'index'"):
        data.rename("features", "index")
    with pytest.raises(ValueError, match="no column 'nope'"):
        data.rename("nope", "x")
    with pytest.raises(ValueError, match="1 old keys"):
        data.rename(["d"], ["a", "b"])


# ------------------------------------------------------------------------------------- split and combine
def test_chunk_gives_equal_views() -> None:
    data = make(6)
    parts = data.chunk(3)
    assert [row_ids(p) for p in parts] == [[0, 1], [2, 3], [4, 5]]
    for i, p in enumerate(parts):
        assert p.batch["x"].data_ptr() == data.batch["x"][2 * i].data_ptr()
        assert np.shares_memory(p.non_tensor_batch["d"], data.non_tensor_batch["d"])
        assert p.meta_info == data.meta_info and p.meta_info is not data.meta_info
    with pytest.raises(ValueError, match=r"6 rows are not divisible by 4.*pad_to_divisor\(4\)"):
        data.chunk(4)
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        data.chunk(0)
    meta_only = DataProto.empty({"cmd": "sync"}).chunk(4)
    assert len(meta_only) == 4 and all(p.meta_info == {"cmd": "sync"} for p in meta_only)


def test_split_last_part_shorter() -> None:
    data = make(7)
    parts = data.split(3)
    assert [row_ids(p) for p in parts] == [[0, 1, 2], [3, 4, 5], [6]]
    assert parts[1].batch["ids"].data_ptr() == data.batch["ids"][3].data_ptr()
    assert data.split(10)[0].batch["ids"].tolist() == list(range(7))
    with pytest.raises(ValueError, match="split_size must be >= 1"):
        data.split(0)


def test_concat_rows_and_meta_info() -> None:
    parts = make(6).chunk(3)
    parts[0].meta_info.update(step=1, rank=0, metrics={"loss": 1.0})
    parts[1].meta_info.update(step=1, rank=1, metrics=[{"loss": 2.0}, {"loss": 3.0}])
    parts[2].meta_info.update(step=1, rank=2)
    out = DataProto.concat(parts)
    assert row_ids(out) == list(range(6))
    assert not shares(out.batch["x"], parts[0].batch["x"])
    assert out.meta_info == {"temperature": 1.0, "step": 1,
                             "metrics": [{"loss": 1.0}, {"loss": 2.0}, {"loss": 3.0}]}
    assert "metrics" not in DataProto.concat(make(2).chunk(2)).meta_info
    with pytest.raises(ValueError, match="part 1 has batch keys"):
        DataProto.concat([make(2), make(2).select(batch_keys=["x"])])
    with pytest.raises(ValueError, match="at least one"):
        DataProto.concat([])


def test_repeat_interleaved_vs_blocked() -> None:
    data = make(3)
    inter = data.repeat(3, interleave=True)
    blocked = data.repeat(3, interleave=False)
    assert row_ids(inter) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert row_ids(blocked) == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    naive = torch.stack([data.batch["x"][i] for i in range(3) for _ in range(3)])
    assert torch.equal(inter.batch["x"], naive)
    assert inter.meta_info == data.meta_info and row_ids(data.repeat()) == [0, 0, 1, 1, 2, 2]
    two_d = DataProto(non_tensor_batch={"m": np.arange(6).reshape(3, 2)})
    assert two_d.repeat(2, interleave=False).non_tensor_batch["m"][:, 0].tolist() == [0, 2, 4, 0, 2, 4]
    with pytest.raises(ValueError, match="repeat_times must be >= 1"):
        data.repeat(0)


@pytest.mark.parametrize("n,divisor,expected_pad", [(5, 4, 3), (3, 8, 5), (8, 4, 0), (1, 1, 0)])
def test_pad_to_divisor_round_trip(n: int, divisor: int, expected_pad: int) -> None:
    data = make(n, meta={"metrics": [1]})
    padded, pad_size = data.pad_to_divisor(divisor)
    assert pad_size == expected_pad and len(padded) % divisor == 0
    naive = list(range(n)) + [i % n for i in range(pad_size)]  # leading rows repeated, like verl
    assert row_ids(padded) == naive and padded.meta_info == {"metrics": [1]}
    out = DataProto.concat([c for c in padded.chunk(divisor)]).unpad(pad_size)
    assert row_ids(out) == list(range(n))
    if pad_size == 0:
        assert padded is data
    fn_padded, fn_pad = pad_dataproto_to_divisor(data, divisor)
    assert fn_pad == pad_size and row_ids(unpad_dataproto(fn_padded, fn_pad)) == list(range(n))


def test_pad_and_unpad_errors() -> None:
    assert DataProto(batch={"a": torch.zeros(0)}).pad_to_divisor(3)[1] == 0  # 0 rows divide evenly
    with pytest.raises(ValueError, match="size_divisor must be >= 1"):
        make(2).pad_to_divisor(0)
    with pytest.raises(ValueError, match=r"pad_size must be in \[0, 2\], got 3"):
        make(2).unpad(3)
    view = make(4).unpad(1)
    assert row_ids(view) == [0, 1, 2]


# ------------------------------------------------------------------------------------- device and epochs
def test_to_moves_tensors_in_place() -> None:
    data = make(3)
    assert data.to("meta") is data
    assert all(v.device.type == "meta" for v in data.batch.values())
    assert list(data.non_tensor_batch["s"]) == ["s0", "s1", "s2"]


def test_make_iterator_is_deterministic_with_seed() -> None:
    data = make(8, meta={"epoch_info": 1})

    def orders(seed: int | None, shuffle: bool = True) -> list[list[int]]:
        return [row_ids(mb) for mb in data.make_iterator(2, epochs=3, seed=seed, shuffle=shuffle)]

    first = orders(seed=7)
    assert len(first) == 12 and all(len(mb) == 2 for mb in first)
    for epoch in range(3):  # every epoch is a permutation of all rows
        assert sorted(sum(first[epoch * 4:(epoch + 1) * 4], [])) == list(range(8))
    assert orders(seed=7) == first
    assert orders(seed=8) != first
    assert sum(first[:4], []) != sum(first[4:8], [])  # epochs are reshuffled
    assert orders(seed=None, shuffle=False) == [[0, 1], [2, 3], [4, 5], [6, 7]] * 3
    assert all(mb.meta_info == {"epoch_info": 1} for mb in data.make_iterator(4, 1))
    with pytest.raises(ValueError, match="8 rows are not divisible by mini_batch_size=3.*pad_to_divisor"):
        data.make_iterator(3, epochs=1)


# ---------------------------------------------------------------------------------------------------- disk
def test_save_load_round_trip(tmp_path) -> None:
    n = 4
    base = torch.arange(n * 6).view(n, 6)
    data = DataProto.from_dict(
        tensors={
            "f32": torch.randn(n, 3),
            "bf16": torch.randn(n, 5).to(torch.bfloat16),
            "i64": base,
            "alias": base,  # two keys on one storage: safetensors refuses that unless we copy
            "mask": torch.rand(n, 2) > 0.5,
            "strided": torch.randn(3, n).t(),  # non-contiguous
        },
        non_tensors={
            "text": ["hello", "wörld", "", "x"],
            "maybe": [None, 1, 2.5, True],
            "info": [{"a": [1, {"b": None}]}, {}, {"c": "d"}, {"e": 1.5}],
            "pairs": [[1, 2], [3, 4], [5, 6], [7, 8]],
            "npscalar": [np.int64(3), np.float32(0.5), np.bool_(True), np.str_("s")],
        },
        meta_info={"temperature": 0.7, "eos": [1, 2], "nested": {"k": None}, "flag": False},
    )
    data.non_tensor_batch["ints"] = np.arange(n * 2).reshape(n, 2)
    data.non_tensor_batch["grid"] = np.empty((n, 2), dtype=object)
    data.non_tensor_batch["grid"][:] = "g"
    data.save(tmp_path / "dp")
    assert sorted(p.name for p in (tmp_path / "dp").iterdir()) == ["data.json", "tensors.safetensors"]
    loaded = DataProto.load(tmp_path / "dp")
    assert loaded.keys() == data.keys() and loaded.meta_info == data.meta_info
    for key, value in data.batch.items():
        assert loaded.batch[key].dtype == value.dtype and torch.equal(loaded.batch[key], value), key
    for key, value in data.non_tensor_batch.items():
        got = loaded.non_tensor_batch[key]
        assert got.dtype == value.dtype and got.shape == value.shape, key
        assert got.tolist() == value.tolist(), key
    assert loaded.non_tensor_batch["pairs"][0] == [1, 2] and loaded.non_tensor_batch["pairs"].shape == (n,)


def test_save_of_a_view_writes_only_its_rows(tmp_path) -> None:
    data = make(10)
    data[3:5].save(tmp_path / "v")
    loaded = DataProto.load(tmp_path / "v")
    assert row_ids(loaded) == [3, 4] and loaded.meta_info == {"temperature": 1.0}
    header = json.loads((tmp_path / "v" / "data.json").read_text())
    assert header["num_rows"] == 2 and header["format"] == "hybridflow.DataProto"
    DataProto.empty({"only": "meta"}).save(tmp_path / "e")
    assert DataProto.load(tmp_path / "e").meta_info == {"only": "meta"}


@pytest.mark.parametrize("non_tensors,meta,message", [
    ({"obj": [1, object()]}, {}, r"non_tensor_batch\['obj'\]\[1\] holds a object"),
    ({"nested": [{"a": [1, torch.zeros(1)]}]}, {}, r"non_tensor_batch\['nested'\]\[0\]\['a'\]\[1\] holds a Tensor"),
    ({"t": [(1, 2)]}, {}, r"holds a tuple.*use a list"),
    ({"k": [{1: "x"}]}, {}, r"non_tensor_batch\['k'\]\[0\] has the non-string dict key 1"),
    ({}, {"bad": {1, 2}}, r"meta_info\['bad'\] holds a set"),
])
def test_save_refuses_non_json_values(tmp_path, non_tensors, meta, message) -> None:
    rows = len(next(iter(non_tensors.values()))) if non_tensors else 1
    data = DataProto.from_dict({"a": torch.zeros(rows)}, non_tensors, meta)
    with pytest.raises(ValueError, match=message):
        data.save(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()  # validated before anything is written


def test_load_errors(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a saved DataProto"):
        DataProto.load(tmp_path)
    make(2).save(tmp_path / "d")
    (tmp_path / "d" / "data.json").write_text(json.dumps({"format": "other", "version": 1}))
    with pytest.raises(ValueError, match="is not 'hybridflow.DataProto' version 1"):
        DataProto.load(tmp_path / "d")


def test_pickle_round_trip_for_rpc() -> None:
    data = make(3)
    out = pickle.loads(pickle.dumps(data))
    assert row_ids(out) == [0, 1, 2] and out.meta_info == data.meta_info


def test_values_equal_treats_nan_in_the_same_place_as_equal() -> None:
    from hybridflow.protocol.indexing import values_equal

    a = torch.tensor([1.0, float("nan"), float("inf")])
    assert values_equal(a, a.clone())
    assert not values_equal(a, torch.tensor([1.0, 2.0, float("inf")]))
    assert not values_equal(a, torch.tensor([float("nan"), float("nan"), float("inf")]))
    assert values_equal(torch.tensor([1, 2]), torch.tensor([1, 2])) and not values_equal(torch.tensor([1]), a[:1])
