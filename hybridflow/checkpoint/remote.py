"""Mirror finished local checkpoints to any fsspec URL (`hdfs://`, `s3://`, `file://`, `memory://`) and back.

Object stores have no atomic directory rename, so the mirror uploads every file of a checkpoint first and its
`checkpoint.json` marker last, then rewrites the remote `latest`; a remote reader trusts only marked directories.
URLs are joined by `join_url`, which is correct with and without a trailing `/` (the blog's HDFS bug).
"""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
from pathlib import Path

from fsspec.core import url_to_fs

from hybridflow.checkpoint import atomic

logger = logging.getLogger(__name__)


def join_url(base: str, *parts: str) -> str:
    """Join URL/path segments with exactly one `/` between them, keeping the scheme's `//` and a root `/`.

    join_url("hdfs://nn/ckpt", "a") == join_url("hdfs://nn/ckpt/", "a") == "hdfs://nn/ckpt/a";
    join_url("memory://", "a") == "memory://a"; join_url("file:///", "a") == "file:///a".
    """
    scheme, sep, rest = base.partition("://")
    if not sep:
        scheme, rest = "", base
    stripped = rest.rstrip("/")
    rooted = rest.startswith("/") and stripped == ""
    segs = [p.strip("/") for p in parts if p and p.strip("/")]
    path = "/".join(([stripped] if stripped else []) + segs)
    if rooted:
        path = "/" + path
    return f"{scheme}://{path}" if sep else path


def is_remote_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


class RemoteMirror:
    """Upload/download checkpoint directories under one fsspec base URL."""

    def __init__(self, base_url: str) -> None:
        if not base_url or not isinstance(base_url, str):
            raise ValueError(f"trainer.default_hdfs_dir={base_url!r}: give an fsspec URL such as "
                             "hdfs://namenode:8020/user/me/ckpt, s3://bucket/run or file:///mnt/ckpt")
        self.base_url = base_url
        try:
            self.fs, _ = url_to_fs(base_url)
        except (ImportError, ValueError) as err:
            raise ValueError(f"trainer.default_hdfs_dir={base_url!r}: fsspec cannot open it ({err}); install the "
                             "filesystem's package (e.g. s3fs, pyarrow for hdfs) or fix the URL") from err

    def url(self, *parts: str) -> str:
        return join_url(self.base_url, *parts)

    def _path(self, *parts: str) -> str:
        return url_to_fs(self.url(*parts))[1]

    def upload(self, local_dir: Path) -> str:
        """Copy a complete local checkpoint to `<base>/<name>` (marker last), then point remote `latest` at it."""
        local_dir = Path(local_dir)
        if not atomic.is_complete(local_dir):
            raise AssertionError(f"refusing to mirror incomplete checkpoint {local_dir}")
        name = local_dir.name
        self.delete(name)  # a partial upload from a crash, or an older save of this step
        files = sorted(p for p in local_dir.rglob("*") if p.is_file() and p.name != atomic.MARKER)
        for f in [*files, local_dir / atomic.MARKER]:
            target = self._path(name, f.relative_to(local_dir).as_posix())
            self.fs.makedirs(posixpath.dirname(target), exist_ok=True)
            self.fs.put_file(str(f), target)
        with self.fs.open(self._path(atomic.LATEST), "w") as fh:
            fh.write(name + "\n")
        logger.info("mirrored %s to %s", local_dir, self.url(name))
        return self.url(name)

    def is_complete(self, name: str) -> bool:
        return self.fs.exists(self._path(name, atomic.MARKER))

    def list_complete(self) -> list[tuple[int, str]]:
        base = self._path()
        names = [e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(base, detail=False)] if self.fs.exists(base) else []
        return sorted((atomic.parse_step(n), n) for n in names if atomic.parse_step(n) is not None and self.is_complete(n))

    def find_latest(self) -> str | None:
        """Name of the newest complete remote checkpoint (pointer first, scan as fallback)."""
        name = None
        if self.fs.exists(self._path(atomic.LATEST)):
            with self.fs.open(self._path(atomic.LATEST), "r") as fh:
                name = fh.read().strip() or None
        return atomic.newest(self.list_complete(), name, self.base_url)

    def has_checkpoint(self) -> bool:
        """A complete checkpoint at the base or in a sub-directory of it (roles in their own groups save there)."""
        if self.list_complete():
            return True
        base = self._path()
        subdirs = [e["name"] for e in self.fs.ls(base, detail=True) if e["type"] == "directory"] \
            if self.fs.exists(base) else []
        return any(RemoteMirror(self.url(posixpath.basename(d.rstrip("/")))).list_complete() for d in subdirs)

    def download(self, name: str, local_root: Path) -> Path:
        """Fetch remote checkpoint `name` into `<local_root>/<name>` atomically (temp dir + rename)."""
        if not self.is_complete(name):
            raise FileNotFoundError(f"{self.url(name)} is not a complete checkpoint (no {atomic.MARKER})")
        final = Path(local_root) / name
        tmp = atomic.tmp_path_for(final)
        shutil.rmtree(tmp, ignore_errors=True)
        src = self._path(name)
        for remote_file in self.fs.find(src):
            dst = tmp / remote_file[len(src):].lstrip("/")
            dst.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(remote_file, str(dst))
        atomic.fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        logger.info("downloaded %s to %s", self.url(name), final)
        return final

    def delete(self, name: str) -> None:
        path = self._path(name)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)
            logger.info("removed remote checkpoint %s", self.url(name))
