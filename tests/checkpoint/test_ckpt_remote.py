"""Remote mirror (memory://, file://), URL joining, remote-only resume and resume modes."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import fsspec
import pytest
import torch

from hybridflow.checkpoint import (
    CheckpointManager,
    CheckpointWriteError,
    atomic,
    find_resume_checkpoint,
    join_url,
)
from hybridflow.checkpoint.remote import RemoteMirror


@pytest.mark.parametrize("base,expected", [
    ("hdfs://nn:8020/user/me/ckpt", "hdfs://nn:8020/user/me/ckpt/global_step_3/actor"),
    ("hdfs://nn:8020/user/me/ckpt/", "hdfs://nn:8020/user/me/ckpt/global_step_3/actor"),
    ("hdfs://nn:8020/user/me/ckpt//", "hdfs://nn:8020/user/me/ckpt/global_step_3/actor"),
    ("s3://bucket", "s3://bucket/global_step_3/actor"),
    ("s3://bucket/", "s3://bucket/global_step_3/actor"),
    ("file:///tmp/x", "file:///tmp/x/global_step_3/actor"),
    ("file:///tmp/x/", "file:///tmp/x/global_step_3/actor"),
    ("file:///", "file:///global_step_3/actor"),
    ("memory://", "memory://global_step_3/actor"),
    ("memory://run/", "memory://run/global_step_3/actor"),
    ("/local/dir/", "/local/dir/global_step_3/actor"),
    ("relative", "relative/global_step_3/actor"),
])
def test_join_url_with_and_without_trailing_slash(base: str, expected: str) -> None:
    assert join_url(base, "global_step_3", "actor") == expected
    assert join_url(base, "/global_step_3/", "actor/") == expected


def _mem_url() -> str:
    return f"memory://hf-test-{uuid.uuid4().hex[:8]}/ckpt/"


def _state(v: float) -> dict:
    return {"model": {"w": torch.full((4, 4), v), "b": torch.arange(3) * v}, "sched": {"last_epoch": int(v)}}


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_mirror_then_remote_only_resume(tmp_path: Path, kind: str) -> None:
    url = _mem_url() if kind == "memory" else f"file://{tmp_path}/remote"  # no trailing slash here
    local = tmp_path / "local"
    with CheckpointManager(local, url, keep_last_n=1, async_save=True) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"actor": _state(float(step))}, extra={"step": step})
    mirror = RemoteMirror(url)
    assert [s for s, _ in mirror.list_complete()] == [3]  # the mirror follows keep_last_n too
    assert mirror.find_latest() == "global_step_3"
    assert [s for s, _ in atomic.list_complete(local)] == [3]
    # lose the local disk: resume must come from the remote copy
    shutil.rmtree(local)
    mgr2 = CheckpointManager(local, url, async_save=False)
    path = find_resume_checkpoint(mgr2, "auto")
    assert path == local / "global_step_3" and atomic.is_complete(path)
    loaded = mgr2.load(path)
    assert loaded.step == 3 and loaded.extra == {"step": 3}
    assert torch.equal(loaded.components["actor"]["model"]["w"], torch.full((4, 4), 3.0))
    assert loaded.components["actor"]["sched"] == {"last_epoch": 3}


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_remote_retention_follows_keep_last_n(tmp_path: Path, kind: str) -> None:
    """Issue 20: with keep_last_n=3 the mirror kept steps 1-8. Old remote steps go once a newer one is complete
    there; the protected (best) step and a partial upload's directory are left alone."""
    url = _mem_url() if kind == "memory" else f"file://{tmp_path}/remote/"
    fs, root = fsspec.core.url_to_fs(url)
    partial = root.rstrip("/") + "/global_step_0/actor/skeleton.json"
    fs.makedirs(partial.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe(partial, b"{}")  # a crashed upload of an older run: not complete, never counted or deleted
    mirror = RemoteMirror(url)
    with CheckpointManager(tmp_path / "local", url, keep_last_n=2, async_save=True) as mgr:
        mgr.protect([2])
        for step in range(1, 7):
            mgr.save(step, {"actor": _state(float(step))})
            mgr.wait()
            if step == 3:
                assert [s for s, _ in mirror.list_complete()] == [2, 3]
    assert [s for s, _ in mirror.list_complete()] == [2, 5, 6]
    assert [s for s, _ in atomic.list_complete(tmp_path / "local")] == [2, 5, 6]
    assert fs.exists(partial) and mirror.find_latest() == "global_step_6"


def test_remote_retention_waits_for_a_complete_upload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = _mem_url()
    mirror = RemoteMirror(url)
    with CheckpointManager(tmp_path, url, keep_last_n=1, async_save=False) as mgr:
        mgr.save(1, {"actor": _state(1.0)})

        def failing_upload(self: RemoteMirror, local_dir: Path) -> str:
            raise OSError("remote store unavailable")

        monkeypatch.setattr(RemoteMirror, "upload", failing_upload)
        with pytest.raises(CheckpointWriteError, match="mirroring it"):
            mgr.save(2, {"actor": _state(2.0)})
    assert [s for s, _ in mirror.list_complete()] == [1]  # the only complete remote copy survives


def test_partial_remote_upload_is_ignored() -> None:
    url = _mem_url()
    fs, root = fsspec.core.url_to_fs(url)
    fs.pipe(root.rstrip("/") + "/global_step_9/actor/skeleton.json", b"{}")  # crashed upload: no marker
    assert RemoteMirror(url).find_latest() is None
    assert RemoteMirror(url).list_complete() == []


def test_resume_modes(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, async_save=False)
    assert find_resume_checkpoint(mgr, "auto") is None
    mgr.save(5, {"actor": _state(5.0)})
    mgr.save(6, {"actor": _state(6.0)})
    assert find_resume_checkpoint(mgr, "disable") is None
    assert find_resume_checkpoint(mgr, "auto") == tmp_path / "global_step_6"
    assert find_resume_checkpoint(mgr, "path", str(tmp_path / "global_step_5")) == tmp_path / "global_step_5"
    assert find_resume_checkpoint(mgr, "path", str(tmp_path)) == tmp_path / "global_step_6"
    with pytest.raises(ValueError, match="trainer.resume_path"):
        find_resume_checkpoint(mgr, "path", str(tmp_path / "global_step_77"))
    with pytest.raises(ValueError, match="resume_mode"):
        find_resume_checkpoint(mgr, "sometimes")


def test_resume_path_may_be_a_remote_url(tmp_path: Path) -> None:
    url = _mem_url()
    with CheckpointManager(tmp_path / "a", url, async_save=False) as mgr:
        mgr.save(4, {"actor": _state(4.0)})
    mgr2 = CheckpointManager(tmp_path / "b", async_save=False)
    path = find_resume_checkpoint(mgr2, "path", join_url(url, "global_step_4"))
    assert path == tmp_path / "b" / "global_step_4"
    assert mgr2.load(path).step == 4


def test_pointer_and_scan_fallbacks(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, async_save=False)
    mgr.save(1, {"a": _state(1.0)})
    mgr.save(2, {"a": _state(2.0)})
    (tmp_path / "latest").write_text("global_step_1\n")  # crash between rename and pointer update
    assert atomic.find_latest(tmp_path) == tmp_path / "global_step_2"
    (tmp_path / "latest").write_text("global_step_99\n")  # pointer to a deleted checkpoint
    assert atomic.find_latest(tmp_path) == tmp_path / "global_step_2"
    (tmp_path / ".tmp_global_step_3").mkdir()  # crashed atomic save
    (tmp_path / ".tmp_global_step_3" / atomic.MARKER).write_text('{"complete": true}')
    assert atomic.find_latest(tmp_path) == tmp_path / "global_step_2"


def test_remote_failure_is_reported_after_local_completes(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, "file:///dev/null/not-a-dir", async_save=True)
    mgr.save(1, {"a": _state(1.0)})
    with pytest.raises(CheckpointWriteError, match="local checkpoint .* is complete"):
        mgr.wait()
    assert atomic.find_latest(tmp_path) == tmp_path / "global_step_1"
