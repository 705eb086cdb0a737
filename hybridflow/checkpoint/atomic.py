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


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    # Directory fsync makes renames/creations inside it durable (POSIX); some filesystems refuse it.
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as err:
        logger.debug("cannot open %s for fsync: %s", path, err)
        return
    try:
        os.fsync(fd)
    except OSError as err:
        logger.debug("fsync of directory %s not supported: %s", path, err)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file, then every directory bottom-up, under `root` (inclusive)."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_file(Path(dirpath) / name)
        fsync_dir(Path(dirpath))


def write_json(path: Path, obj: Any, fsync: bool = True) -> None:
    """Write JSON through a sibling temp file and `os.replace`, so readers see the old or the new file."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def is_complete(ckpt_dir: Path) -> bool:
    """A directory is a complete checkpoint iff its name is not temporary and its marker parses."""
    ckpt_dir = Path(ckpt_dir)
    if ckpt_dir.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
        return False
    try:
        meta = read_json(ckpt_dir / MARKER)
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


def commit_dir(work: Path, final: Path, marker: dict[str, Any], atomic: bool) -> None:
    """Write the marker last, fsync everything, then (atomic) rename `work` → `final` and fsync the parent."""
    write_json(work / MARKER, {**marker, "complete": True}, fsync=False)
    fsync_tree(work)
    if not atomic:
        fsync_dir(final.parent)
        return
    if final.exists():
        # Re-saving a step (after a rollback): move the old one aside first; rename cannot replace a non-empty dir.
        trash = final.parent / f"{TRASH_PREFIX}{final.name}"
        if trash.exists():
            shutil.rmtree(trash)
        os.rename(final, trash)
        os.rename(work, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(work, final)
    fsync_dir(final.parent)


def write_latest(root: Path, name: str) -> None:
    """Point `<root>/latest` at checkpoint `name` (atomic replace; written after the checkpoint is complete)."""
    tmp = root / f"{TMP_PREFIX}{LATEST}.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


def read_latest(root: Path) -> str | None:
    try:
        name = (Path(root) / LATEST).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return name or None


def list_complete(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root`, sorted by step (oldest first)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        step = parse_step(child.name)
        if step is not None and child.is_dir() and is_complete(child):
            out.append((step, child))
    return sorted(out)


def find_latest(root: Path) -> Path | None:
    """The newest complete checkpoint: the `latest` pointer if it names a complete one, else the highest step.

    Scanning as well as reading the pointer covers a crash between the rename and the pointer update, and a
    pointer that names a checkpoint since deleted or corrupted.
    """
    root = Path(root)
    complete = list_complete(root)
    name = read_latest(root)
    if name is not None:
        target = root / name
        pointed = parse_step(name)
        if is_complete(target) and pointed is not None:
            newer = [p for s, p in complete if s > pointed]
            if newer:
                logger.warning("%s/latest names %s but %s is newer and complete; using the newer one",
                               root, name, newer[-1].name)
                return newer[-1]
            return target
        logger.warning("%s/latest names %r, which is not a complete checkpoint; scanning instead", root, name)
    return complete[-1][1] if complete else None


def find_latest_of_run(root: Path) -> Path | None:
    """The newest complete checkpoint of a run directory: under `root` itself (one group) or under one of its role
    sub-directories (`actor/`, `critic/`: roles in their own groups save there)."""
    root = Path(root)
    if not root.is_dir():
        return None
    found = [p for p in [find_latest(root), *(find_latest(sub) for sub in sorted(root.iterdir()) if sub.is_dir())]
             if p is not None]
    return max(found, key=lambda p: parse_step(p.name) or 0) if found else None


def clean_stale(root: Path) -> list[Path]:
    """Remove `.tmp_*`/`.trash_*` leftovers of crashed saves. Call only when no save is in flight."""
    root = Path(root)
    removed = []
    if not root.is_dir():
        return removed
    for child in root.iterdir():
        if child.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
            removed.append(child)
    if removed:
        logger.info("removed %d leftovers of interrupted saves under %s", len(removed), root)
    return removed
