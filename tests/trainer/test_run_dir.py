"""One run per run directory and one run at a time: a fresh run into a directory holding another run's metrics is
refused (or replaces them with `trainer.overwrite=true`), and a second live run on the same directories is refused
with the holder named; a lock left by a killed run does not block the next."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ppo_testlib import tiny_ppo_config

from hybridflow.tracking.jsonl import read_jsonl
from hybridflow.trainer.run import run_ppo
from hybridflow.trainer.run_dir import LOCK_FILE, RunDirInUse, claimed_run_dirs


def _cfg(tmp_path: Path, *extra: str):
    return tiny_ppo_config(tmp_path, tmp_path / "ckpt", 2, "trainer.logger=[jsonl]", f"trainer.run_dir={tmp_path}/run",
                           "trainer.total_training_steps=2", "trainer.checkpoint.async_save=false", *extra)


def test_fresh_run_into_a_used_run_dir_is_refused_and_overwrite_replaces(tmp_path: Path) -> None:
    run_ppo(_cfg(tmp_path, "trainer.checkpoint.save_freq=0"))  # leaves metrics, no checkpoint to resume
    with pytest.raises(ValueError, match=r"trainer.run_dir=.*holds another run's metrics.*trainer.overwrite=true"):
        run_ppo(_cfg(tmp_path, "trainer.checkpoint.save_freq=0"))
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2]  # nothing lost

    run_ppo(_cfg(tmp_path, "trainer.checkpoint.save_freq=0", "trainer.overwrite=true"))
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2]  # one run, not 1,2,1,2


def test_a_run_that_resumes_may_use_its_run_dir(tmp_path: Path) -> None:
    run_ppo(_cfg(tmp_path, "trainer.checkpoint.save_freq=1"))
    history = run_ppo(_cfg(tmp_path, "trainer.checkpoint.save_freq=1", "trainer.total_training_steps=3"))
    assert [int(m["training/global_step"]) for m in history] == [3]


def test_second_live_run_on_the_same_dirs_is_refused_naming_the_holder(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    with claimed_run_dirs(cfg):
        with pytest.raises(RunDirInUse, match=r"trainer.run_dir=.* is in use by a running run \(pid \d+ on "):
            with claimed_run_dirs(cfg):
                pass
    with claimed_run_dirs(cfg):  # released when the first run ended
        pass


def test_lock_of_a_killed_run_is_not_stale(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"f = open({str(run_dir / LOCK_FILE)!r}, 'a+'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        "f.write('{\"pid\": 1}'); f.flush(); print('locked', flush=True); time.sleep(600)\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirInUse):
            with claimed_run_dirs(_cfg(tmp_path)):
                pass
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    with claimed_run_dirs(_cfg(tmp_path)):
        info = json.loads((run_dir / LOCK_FILE).read_text())
    assert info["pid"] != 1 and info["host"]


def test_an_attempt_that_logged_no_step_does_not_block_a_fresh_run(tmp_path: Path) -> None:
    from hybridflow.trainer.run_dir import check_fresh_run_dir

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "events.jsonl").write_text('{"kind": "run_end", "status": "failed"}\n')
    check_fresh_run_dir(_cfg(tmp_path, "trainer.checkpoint.save_freq=0"))  # failed at start: nothing to mix with
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match="holds another run's metrics"):
        check_fresh_run_dir(_cfg(tmp_path, "trainer.checkpoint.save_freq=0"))


def test_a_run_whose_roles_saved_apart_counts_as_resumable(tmp_path: Path) -> None:
    """PPO with the critic in its own group saves under actor/ and critic/: a fresh-run check and the command's
    summary must see those checkpoints (they looked at the root only)."""
    import json as _json

    from hybridflow.checkpoint import atomic
    from hybridflow.trainer.run_dir import will_resume

    cfg = _cfg(tmp_path)
    assert not will_resume(cfg)
    for role in ("actor", "critic"):
        step = tmp_path / "ckpt" / role / "global_step_4"
        step.mkdir(parents=True)
        (step / atomic.MARKER).write_text(_json.dumps({"complete": True, "step": 4}))
    assert atomic.find_latest_of_run(tmp_path / "ckpt") is not None
    assert atomic.find_latest_of_run(tmp_path / "ckpt").name == "global_step_4"
    assert will_resume(cfg)


def test_a_run_with_its_checkpoints_only_in_the_mirror_counts_as_resumable(tmp_path: Path) -> None:
    """A run restarted on fresh machines (no local checkpoint) resumes from `trainer.default_hdfs_dir`: the fresh-run
    check must see the mirror's checkpoints, at its root or under a role's sub-directory, not refuse the run."""
    from hybridflow.checkpoint import atomic
    from hybridflow.trainer.run_dir import check_fresh_run_dir, will_resume

    remote = tmp_path / "object_store"
    cfg = _cfg(tmp_path, "trainer.checkpoint.save_freq=1", f"trainer.default_hdfs_dir=file://{remote}")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    (remote / "global_step_3").mkdir(parents=True)  # a save that never finished in the mirror: no marker
    assert not will_resume(cfg)
    with pytest.raises(ValueError, match=f"trainer.default_hdfs_dir=file://{remote}"):
        check_fresh_run_dir(cfg)
    step = remote / "critic" / "global_step_2"
    step.mkdir(parents=True)
    (step / atomic.MARKER).write_text(json.dumps({"complete": True, "step": 2}))
    assert will_resume(cfg)
    step.rename(remote / "global_step_2")  # one group: at the mirror's root
    assert will_resume(cfg)
    check_fresh_run_dir(cfg)
