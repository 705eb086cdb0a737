"""Crash-safe directory layout: temp dir + fsync + rename, a completion marker, and the `latest` pointer.

A checkpoint counts as complete only when its `checkpoint.json` marker exists (written and fsynced last, before
the rename when atomic), so a crash at any moment never leaves a half checkpoint that looks complete — also with
`atomic_save=false`. Loaders skip `.tmp_*` directories and anything without the marker.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MARKER = "checkpoint.json"
LATEST = "latest"
TMP_PREFIX = ".tmp_"
TRASH_PREFIX = ".trash_"
STEP_PREFIX = "global_step_"
_STEP_RE = re.compile(rf"^{STEP_PREFIX}(\d+)$")


def step_dirname(step: int) -> str:
    return f"{STEP_PREFIX}{int(step)}"


def parse_step(name: str) -> int | None:
    """`global_step_12` → 12; anything else (including `.tmp_global_step_12`) → None."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def tmp_path_for(final: Path) -> Path:
    return final.parent / f"{TMP_PREFIX}{final.name}"


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory (makes renames and creations inside it durable; some filesystems refuse)."""
    is_dir = path.is_dir()
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if is_dir else 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        if not is_dir:
            raise
        logger.debug("fsync of directory %s not supported: %s", path, err)


def fsync_tree(root: Path) -> None:
    """fsync every file, then every directory bottom-up, under `root` (inclusive)."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def _replace_text(path: Path, text: str, fsync: bool) -> None:
    """Write through a sibling temp file and `os.replace`, so readers see the old or the new file."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        fsync_path(path.parent)


def write_json(path: Path, obj: Any, fsync: bool = True) -> None:
    _replace_text(path, json.dumps(obj, indent=1, sort_keys=True), fsync)


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def is_complete(ckpt_dir: Path) -> bool:
    """A directory is a complete checkpoint iff its name is not temporary and its marker parses."""
    if Path(ckpt_dir).name.startswith((TMP_PREFIX, TRASH_PREFIX)):
        return False
    try:
        meta = read_json(Path(ckpt_dir) / MARKER)
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("complete") is True


def prepare_dir(final: Path, atomic: bool) -> Path:
    """Create the directory a save writes into: `.tmp_<name>` when atomic, else `final` itself (marker removed)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    work = tmp_path_for(final) if atomic else final
    if work.exists():
        # Left by a crashed save of the same step (or an older complete one being overwritten non-atomically).
        shutil.rmtree(work)
    work.mkdir(parents=True)
    return work


def remove_dir(path: Path) -> None:
    """Delete a checkpoint; renamed first, since a half-deleted directory that still holds its marker would look
    complete after a crash."""
    trash = path.parent / f"{TRASH_PREFIX}{path.name}"
    if trash.exists():
        shutil.rmtree(trash)
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)
    logger.info("removed checkpoint %s", path)


def commit_dir(work: Path, final: Path, marker: dict[str, Any], atomic: bool) -> None:
    """Write the marker last, fsync everything, then (atomic) rename `work` → `final` and fsync the parent."""
    write_json(work / MARKER, {**marker, "complete": True}, fsync=False)
    fsync_tree(work)
    if atomic:
        trash = final.parent / f"{TRASH_PREFIX}{final.name}"
        if final.exists():  # re-saving a step (after a rollback): rename cannot replace a non-empty directory
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(final, trash)
        os.rename(work, final)
        shutil.rmtree(trash, ignore_errors=True)
    fsync_path(final.parent)


def write_latest(root: Path, name: str) -> None:
    """Point `<root>/latest` at checkpoint `name` (atomic replace; written after the checkpoint is complete)."""
    _replace_text(root / LATEST, name + "\n", fsync=True)


def read_latest(root: Path) -> str | None:
    path = Path(root) / LATEST
    return (path.read_text(encoding="utf-8").strip() or None) if path.is_file() else None


def list_complete(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, sorted by step (oldest first)."""
    root = Path(root)
    steps = [(parse_step(c.name), c) for c in root.iterdir()] if root.is_dir() else []
    return sorted((s, c) for s, c in steps if s is not None and c.is_dir() and is_complete(c))


def newest(complete: list[tuple[int, Any]], pointed: Any | None, where: str) -> Any | None:
    """The newest complete checkpoint: the one `latest` names (`pointed`, when complete), unless a complete one is
    newer (a crash between the rename and the pointer update), else the highest step."""
    steps = {str(c): s for s, c in complete}
    if pointed is not None and str(pointed) in steps:
        newer = [c for s, c in complete if s > steps[str(pointed)]]
        if newer:
            logger.warning("%s/latest names %s but %s is newer and complete; using the newer one", where, pointed,
                           newer[-1])
        return newer[-1] if newer else pointed
    if pointed is not None:
        logger.warning("%s/latest names %s, which is not a complete checkpoint; scanning instead", where, pointed)
    return complete[-1][1] if complete else None


def find_latest(root: Path) -> Path | None:
    name = read_latest(root)
    return newest(list_complete(root), None if name is None else Path(root) / name, str(root))


def find_latest_of_run(root: Path) -> Path | None:
    """The newest complete checkpoint of a run directory: under `root` itself (one group) or under one of its role
    sub-directories (`actor/`, `critic/`: roles in their own groups save there)."""
    root = Path(root)
    dirs = [root, *sorted(sub for sub in root.iterdir() if sub.is_dir())] if root.is_dir() else []
    found = [p for p in map(find_latest, dirs) if p is not None]
    return max(found, key=lambda p: parse_step(p.name) or 0) if found else None


def clean_stale(root: Path) -> None:
    """Remove `.tmp_*`/`.trash_*` leftovers of crashed saves. Call only when no save is in flight."""
    stale = [c for c in Path(root).iterdir() if c.name.startswith((TMP_PREFIX, TRASH_PREFIX))]
    for child in stale:
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
    if stale:
        logger.info("removed %d leftovers of interrupted saves under %s", len(stale), root)
