"""Claiming a run's directories: one run at a time (a lock), one run per directory (a fresh run does not write its
metrics after another run's).

The lock is `flock` on a file in `trainer.run_dir` and in a local `trainer.default_local_dir`: the kernel releases it
when the process ends, however it ends, so a lock left by a killed run is never stale; the file names the holder
(pid, host, start time) for the message a second run gets.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from hybridflow.checkpoint import atomic
from hybridflow.checkpoint.remote import RemoteMirror
from hybridflow.config import Config
from hybridflow.tracking.jsonl import EVENTS_FILE, METRICS_FILE

logger = logging.getLogger(__name__)

LOCK_FILE = ".hybridflow.lock"


class RunDirInUse(ValueError):
    """Another live run holds the directory."""


def will_resume(cfg: Config) -> bool:
    """Whether the checkpoint policy will resume: `resume_mode=path`, or `auto` with a complete checkpoint in
    `trainer.default_local_dir` (or in a role's sub-directory), else in the `trainer.default_hdfs_dir` mirror (a
    run on fresh machines resumes from there). A remote `default_local_dir` counts as resumable (it is not listed)."""
    t = cfg.trainer
    if t.resume_mode == "path":
        return True
    if t.resume_mode != "auto":
        return False
    if "://" in t.default_local_dir:
        return True
    if atomic.find_latest_of_run(Path(t.default_local_dir)) is not None:
        return True
    return bool(t.default_hdfs_dir) and RemoteMirror(t.default_hdfs_dir).has_checkpoint()


def check_fresh_run_dir(cfg: Config) -> None:
    """A run that starts from scratch into a run directory holding another run's metrics would append to them
    (two runs' step 1..N in one file, one report mixing both): refuse, or clear them with `trainer.overwrite=true`."""
    t = cfg.trainer
    run_dir = Path(t.run_dir)
    logs = [run_dir / name for name in (METRICS_FILE, EVENTS_FILE)]
    metrics = logs[0]
    if not (metrics.is_file() and metrics.stat().st_size > 0) or will_resume(cfg):
        return  # an earlier attempt that logged no step (failed at start) leaves nothing to mix with
    if t.overwrite:
        for path in logs:
            path.unlink(missing_ok=True)
        logger.warning("trainer.overwrite=true: removed the earlier run's %s and %s from %s", METRICS_FILE,
                       EVENTS_FILE, run_dir)
        return
    why = ("trainer.resume_mode=disable" if t.resume_mode == "disable" else
           f"there is no checkpoint to resume in trainer.default_local_dir={t.default_local_dir}"
           + (f" or trainer.default_hdfs_dir={t.default_hdfs_dir}" if t.default_hdfs_dir else ""))
    raise ValueError(
        f"trainer.run_dir={t.run_dir} holds another run's metrics, and this run starts from scratch ({why}). Give "
        "this run its own directory (trainer.experiment_name=NAME or trainer.run_dir=DIR), resume the earlier run "
        "(keep its trainer.default_local_dir and trainer.resume_mode=auto), or set trainer.overwrite=true to "
        "replace the earlier run's metrics")


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, json.JSONDecodeError):
        return "another process"
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')}, started {info.get('started', '?')}"


def _lock_one(directory: Path, key: str, handles: list[IO[str]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    handle = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held open for the run's lifetime
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise RunDirInUse(
            f"{key}={directory} is in use by a running run ({_holder(path)}): wait for it or stop it, or give this "
            "run its own directories (trainer.experiment_name=NAME)") from None
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started": datetime.datetime.now().isoformat(timespec="seconds")}))
    handle.flush()
    handles.append(handle)


@contextlib.contextmanager
def claimed_run_dirs(cfg: Config) -> Iterator[None]:
    """Hold the lock on `trainer.run_dir` and a local `trainer.default_local_dir` for the block, after checking that a
    fresh run does not land in another run's directory."""
    t = cfg.trainer
    handles: list[IO[str]] = []
    try:
        _lock_one(Path(t.run_dir), "trainer.run_dir", handles)
        if "://" not in t.default_local_dir and t.checkpoint.save_freq != 0:
            ckpt = Path(t.default_local_dir).resolve()
            if ckpt != Path(t.run_dir).resolve():
                _lock_one(ckpt, "trainer.default_local_dir", handles)
        check_fresh_run_dir(cfg)
        yield
    finally:
        for handle in handles:
            handle.close()  # closing the file releases its flock
