"""Resume: pick the checkpoint to start from (`trainer.resume_mode` auto|disable|path).

Auto takes the newest complete local checkpoint, else the newest complete remote one (downloaded into the
local dir first, so loading has one code path).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from hybridflow.checkpoint import atomic, collective
from hybridflow.checkpoint.remote import RemoteMirror, is_remote_url, join_url

if TYPE_CHECKING:
    from hybridflow.checkpoint.manager import CheckpointManager

logger = logging.getLogger(__name__)


def find_resume_checkpoint(manager: CheckpointManager, mode: str, resume_path: str | None = None) -> Path | None:
    """The checkpoint directory to resume from, or None to start fresh. Collective when distributed.

    `manager` is a `CheckpointManager` (its local root, remote mirror and rank group are used). A remote
    checkpoint is downloaded by rank 0 into the local root.
    """
    if mode == "disable":
        return None
    if mode == "path":
        if not resume_path:
            raise ValueError("trainer.resume_mode=path needs trainer.resume_path=<checkpoint dir or URL>")
        return _resolve_explicit(manager, resume_path)
    if mode != "auto":
        raise ValueError(f"trainer.resume_mode={mode!r}: must be one of 'auto', 'disable', 'path'")
    local = atomic.find_latest(manager.root)
    if local is not None:
        logger.info("resuming from local checkpoint %s", local)
        return local
    if manager.mirror is None:
        logger.info("no checkpoint under %s; starting fresh", manager.root)
        return None
    name = manager.mirror.find_latest()
    if name is None:
        logger.info("no checkpoint under %s or %s; starting fresh", manager.root, manager.mirror.base_url)
        return None
    return _download(manager, name)


def _resolve_explicit(manager: CheckpointManager, resume_path: str) -> Path:
    if is_remote_url(resume_path):
        base, _, name = resume_path.rstrip("/").rpartition("/")
        mirror = RemoteMirror(base)
        if not mirror.is_complete(name):
            raise ValueError(f"trainer.resume_path={resume_path!r} is not a complete checkpoint (no "
                             f"{join_url(resume_path, atomic.MARKER)})")
        return _download(manager, name, mirror)
    path = Path(resume_path.removeprefix("file://"))
    if not atomic.is_complete(path):
        latest = atomic.find_latest(path)  # a checkpoint root was given: take its latest
        if latest is None:
            raise ValueError(f"trainer.resume_path={resume_path!r} is neither a complete checkpoint "
                             f"(global_step_<N> with {atomic.MARKER}) nor a directory holding one")
        path = latest
    logger.info("resuming from %s", path)
    return path


def _download(manager: CheckpointManager, name: str, mirror: RemoteMirror | None = None) -> Path:
    mirror = mirror or manager.mirror
    assert mirror is not None, "a download needs a mirror (the caller checked manager.mirror)"
    target = manager.root / name
    group = manager._group  # noqa: SLF001 - the manager's gloo group, for the download vote
    if manager.rank == 0 and not atomic.is_complete(target):
        logger.info("no local copy of %s; downloading from %s", name, mirror.url(name))
        collective.phase("download", lambda: mirror.download(name, manager.root), group)
    else:
        collective.phase("download", lambda: None, group)
    return target

