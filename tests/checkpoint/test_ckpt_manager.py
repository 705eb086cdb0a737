"""CheckpointManager round trips, async == sync, snapshot isolation, error surfacing, retention, safe loading."""

from __future__ import annotations

import errno
import json
import pickle
import random
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridflow.checkpoint import CheckpointManager, CheckpointWriteError, atomic
from hybridflow.checkpoint.flatten import flatten_state, unflatten_state
from hybridflow.checkpoint.manager import should_save
from hybridflow.checkpoint.storage import SafeFileSystemReader


def _trained_state(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        model(torch.randn(5, 8)).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}


def _assert_same(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b), (path, list(a), list(b))
        for k in a:
            _assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and np.isnan(a):
        assert np.isnan(b), path
    else:
        assert a == b and type(a) is type(b), (path, a, b)


def test_flatten_roundtrip_keeps_types_and_rejects_objects() -> None:
    state = {"a": {0: torch.ones(2), 1: (torch.zeros(1, dtype=torch.bfloat16), "x")}, "n": np.arange(3),
             "f": [1.5, float("inf"), float("nan"), None, True, 7], "dt": torch.float16}
    tensors, skel = flatten_state(state)
    assert set(tensors) == {"a/0", "a/1/0", "n"}
    back = unflatten_state(json.loads(json.dumps(skel)), tensors)
    _assert_same(state, back)
    with pytest.raises(TypeError, match="at 'bad'"):
        flatten_state({"bad": object()})
    with pytest.raises(ValueError, match="map to the key"):
        flatten_state({"a/b": torch.ones(1), "a": {"b": torch.ones(1)}})


@pytest.mark.parametrize("async_save", [False, True])
def test_roundtrip_model_optimizer_scheduler(tmp_path: Path, async_save: bool) -> None:
    model, opt, state = _trained_state()
    extra = {"step": 3, "sampler": {"epoch": 1, "batch": 2}, "kl_ctrl": {"value": 0.01}}
    with CheckpointManager(tmp_path, async_save=async_save) as mgr:
        final = mgr.save(3, {"actor": state}, extra=extra, rank_state={"seen": [1, 2]})
    assert atomic.is_complete(final) and atomic.read_latest(tmp_path) == "global_step_3"
    loaded = CheckpointManager(tmp_path, async_save=False).load()
    assert loaded.step == 3 and loaded.extra == extra and loaded.rank_state == {"seen": [1, 2]}
    _assert_same(state, loaded.components["actor"])
    # the loaded state drives real modules to the same place
    model2, opt2, _ = _trained_state(seed=1)
    model2.load_state_dict(loaded.components["actor"]["model"])
    opt2.load_state_dict(loaded.components["actor"]["optimizer"])
    x = torch.randn(4, 8)
    for m, o in ((model, opt), (model2, opt2)):
        m(x).sum().backward()
        o.step()
    for p1, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p1, p2)


def test_load_into_templates_in_place(tmp_path: Path) -> None:
    _, _, state = _trained_state()
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"actor": state})
    _, _, template = _trained_state(seed=5)
    weight = template["model"]["0.weight"]
    loaded = CheckpointManager(tmp_path, async_save=False).load(templates={"actor": template})
    assert loaded.components["actor"]["model"]["0.weight"].data_ptr() == weight.data_ptr()  # filled in place
    assert torch.equal(weight, state["model"]["0.weight"])
    bad = {"model": {"0.weight": torch.zeros(3, 3)}}
    with pytest.raises(ValueError, match="has shape"):
        CheckpointManager(tmp_path, async_save=False).load(templates={"actor": bad})


def test_rng_restored(tmp_path: Path) -> None:
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"x": {"t": torch.ones(1)}})
    expected = (random.random(), np.random.rand(), torch.rand(2))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    CheckpointManager(tmp_path).load()
    got = (random.random(), np.random.rand(), torch.rand(2))
    assert expected[0] == got[0] and expected[1] == got[1] and torch.equal(expected[2], got[2])


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_async_writes_same_files_as_sync_and_snapshots(tmp_path: Path) -> None:
    _, _, state = _trained_state()
    big = {"w": torch.randn(512, 1024), "b": torch.arange(10)}
    comps = {"actor": state, "big": big}
    expected = {k: v.clone() for k, v in big.items()}
    torch.manual_seed(0)
    with CheckpointManager(tmp_path / "sync", async_save=False) as mgr:
        mgr.save(7, comps, extra={"a": 1})
    torch.manual_seed(0)
    with CheckpointManager(tmp_path / "async", async_save=True) as mgr:
        mgr.save(7, comps, extra={"a": 1})
        # "training" continues and mutates the live tensors while the writer runs
        big["w"].add_(1.0)
        big["b"].mul_(3)
    a, s = _files(tmp_path / "async" / "global_step_7"), _files(tmp_path / "sync" / "global_step_7")
    assert sorted(a) == sorted(s)
    for name in a:
        if name == "checkpoint.json":
            ja, js = json.loads(a[name]), json.loads(s[name])
            ja.pop("created_unix"), js.pop("created_unix")
            assert ja == js
        else:
            assert a[name] == s[name], name
    loaded = CheckpointManager(tmp_path / "async").load()
    _assert_same(expected, loaded.components["big"])


def test_async_error_surfaces_at_next_save_and_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = CheckpointManager(tmp_path, async_save=True)
    mgr.save(1, {"m": {"w": torch.ones(3)}})
    mgr.wait()

    def read_only(_root: Path) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(atomic, "fsync_tree", read_only)
    mgr.save(2, {"m": {"w": torch.full((3,), 2.0)}})  # returns at once; the writer fails in the background
    deadline = time.monotonic() + 30
    with pytest.raises(CheckpointWriteError, match="step 2.*Read-only file system"):
        while time.monotonic() < deadline:  # the per-step poll reports it without blocking, at the next step
            mgr.poll()
            time.sleep(0.01)
    mgr.save(2, {"m": {"w": torch.full((3,), 2.0)}})
    with pytest.raises(CheckpointWriteError, match="step 2.*Read-only file system"):
        mgr.save(3, {"m": {"w": torch.full((3,), 3.0)}})  # raises instead of saving step 3
    mgr.save(4, {"m": {"w": torch.full((3,), 4.0)}})
    with pytest.raises(CheckpointWriteError, match="step 4.*Read-only"):
        mgr.close()  # exit surfaces the last failure too
    monkeypatch.undo()
    # the earlier checkpoint is still the latest complete one, and no half step looks complete
    assert [s for s, _ in atomic.list_complete(tmp_path)] == [1]
    loaded = CheckpointManager(tmp_path).load()
    assert loaded.step == 1 and torch.equal(loaded.components["m"]["w"], torch.ones(3))


@pytest.mark.parametrize("async_save", [False, True])
def test_unwritable_target_raises_clear_error(tmp_path: Path, async_save: bool) -> None:
    root = tmp_path / "ck"
    mgr = CheckpointManager(root, async_save=async_save)
    shutil.rmtree(root)
    root.write_text("not a directory")  # the target became unwritable after start-up
    if async_save:
        mgr.save(1, {"m": {"w": torch.ones(2)}})
        with pytest.raises(CheckpointWriteError, match="step 1"):
            mgr.wait()
    else:
        with pytest.raises(CheckpointWriteError, match="step 1"):
            mgr.save(1, {"m": {"w": torch.ones(2)}})
    mgr.close()  # the error was reported once; close is clean afterwards


def test_commit_refuses_a_step_whose_other_ranks_wrote_elsewhere(tmp_path: Path) -> None:
    """Ranks on other nodes with a `default_local_dir` on their own disks: rank 0 sees only its own files and must
    not publish (mark complete, point `latest` at, mirror) a step that lacks theirs."""
    mgr = CheckpointManager(tmp_path / "ck", f"file://{tmp_path}/remote", async_save=False)
    mgr.world_size = 2  # rank 1 is on another node: its rank file and shards land on that node's disk
    with pytest.raises(CheckpointWriteError, match=r"rank\(s\) \[1\].*not one directory every node shares"):
        mgr.save(1, {"m": {"w": torch.ones(2)}})
    assert atomic.find_latest(tmp_path / "ck") is None and not (tmp_path / "remote").exists()
    mgr.close()


def test_non_json_extra_fails_in_caller(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(TypeError, match="JSON"):
            mgr.save(1, {"m": {"w": torch.ones(1)}}, extra={"bad": object()})
        assert not mgr._writer.busy


def test_retention_keeps_last_n_and_protected(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last_n=2, async_save=True) as mgr:
        for step in range(1, 7):
            if step == 3:
                mgr.wait()
                mgr.protect({2})
            mgr.save(step, {"m": {"w": torch.full((2,), float(step))}})
    assert [s for s, _ in atomic.list_complete(tmp_path)] == [2, 5, 6]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_2", "global_step_5", "global_step_6", "latest"]


def test_should_save_frequency() -> None:
    assert [s for s in range(1, 8) if should_save(3, s, s == 7)] == [3, 6, 7]
    assert not should_save(0, 5, True)
    assert [s for s in range(1, 5) if should_save(-1, s, s == 4)] == [4]


def test_rollback_to_rewinds_latest(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"m": {"w": torch.ones(1) * step}})
        assert mgr.rollback_to(2).step == 2
        assert atomic.find_latest(tmp_path) == tmp_path / "global_step_2"
        assert [s for s, _ in atomic.list_complete(tmp_path)] == [1, 2]
        loaded = mgr.rollback_to(1)
        assert loaded.step == 1 and torch.equal(loaded.components["m"]["w"], torch.ones(1))
        assert atomic.find_latest(tmp_path) == tmp_path / "global_step_1"
        mgr.save(2, {"m": {"w": torch.full((1,), 7.0)}})  # the new branch re-saves step 2
        mgr.save(2, {"m": {"w": torch.full((1,), 8.0)}})  # and replacing an existing step works too
        assert torch.equal(mgr.load(restore_rng=False).components["m"]["w"], torch.full((1,), 8.0))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", "global_step_2", "latest"]


class _Evil:
    def __reduce__(self):
        return (shutil.rmtree, ("/nonexistent-hybridflow",))


def test_dcp_metadata_reader_refuses_arbitrary_pickles(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(pickle.UnpicklingError, match="not allowed"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()


def test_incomplete_checkpoint_refused(tmp_path: Path) -> None:
    (tmp_path / "global_step_4").mkdir()
    with pytest.raises(ValueError, match="not a complete"):
        CheckpointManager(tmp_path).load(tmp_path / "global_step_4")
    with pytest.raises(FileNotFoundError):
        CheckpointManager(tmp_path).load()


@pytest.mark.parametrize("async_save", [False, True])
def test_tied_and_view_tensors_save(tmp_path: Path, async_save: bool) -> None:
    w, fused = torch.randn(4, 3), torch.randn(6, 3)
    state = {"embed": w, "lm_head": w, "q": fused[:2], "kv": fused[2:], "t": fused.t()}
    with CheckpointManager(tmp_path, async_save=async_save) as mgr:
        mgr.save(1, {"m": state})
    _assert_same(state, CheckpointManager(tmp_path).load(restore_rng=False).components["m"])


@pytest.mark.parametrize("async_save", [False, True])
def test_driver_payload_round_trip_inside_the_commit(tmp_path: Path, async_save: bool) -> None:
    from hybridflow.protocol import DataProto

    rows = DataProto.from_dict({"responses": torch.arange(12).view(3, 4)},
                               {"uid": np.array(["a", "b", "c"], dtype=object)}, meta_info={"n": 4})
    payload = {"rows": rows.to_state(), "version": 1, "metrics": {"x": float("nan")}}
    mgr = CheckpointManager(tmp_path, async_save=async_save)
    path = mgr.save(1, {"m": {"w": torch.ones(2)}}, extra={"a": 1}, payload=payload)
    rows.batch["responses"].add_(100)  # the caller goes on with its rows: the save holds its own copy
    mgr.wait()
    assert (path / "driver" / "tensors.safetensors").is_file() and atomic.is_complete(path)
    loaded = mgr.load()
    back = DataProto.from_state(loaded.payload["rows"])
    assert torch.equal(back.batch["responses"], torch.arange(12).view(3, 4))
    assert list(back.non_tensor_batch["uid"]) == ["a", "b", "c"] and back.meta_info == {"n": 4}
    assert loaded.payload["version"] == 1 and np.isnan(loaded.payload["metrics"]["x"])
    assert "driver" not in loaded.components and mgr.rollback_to(1).payload is None
    assert mgr.load(with_payload=False).payload is None
    mgr.save(2, {"m": {"w": torch.ones(2)}})
    mgr.wait()
    assert mgr.load().payload is None and not (tmp_path / "global_step_2" / "driver").exists()
    with pytest.raises(ValueError, match="'driver'"):
        mgr.save(3, {"driver": {"w": torch.ones(2)}})
    mgr.close()


def test_driver_payload_goes_to_rank_zero_only() -> None:
    from hybridflow.checkpoint.worker import _payload_to_rank_zero
    from hybridflow.controller import DispatchContext

    ctx = DispatchContext(3, "local", lambda: [], "test")
    plan = _payload_to_rank_zero(ctx, (5, {"e": 1}), {"payload": {"t": torch.ones(1)}})
    assert plan.args == [(5, {"e": 1})] * 3
    assert [sorted(k) for k in plan.kwargs] == [["payload"], [], []] and plan.kwargs[0]["payload"]["t"].item() == 1
