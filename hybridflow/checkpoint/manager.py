"""CheckpointManager: the one object a worker calls to save, load, retain, mirror and roll back checkpoints.

Layout: `<local_dir>/global_step_<N>/{checkpoint.json, extra.json, <component>/..., ranks/rank_<r>.json}` plus
`<local_dir>/latest`, and `driver/` (as a component) when the driver gave a payload. `save` validates and flattens
on the caller's thread, stages tensors to CPU when async, then writes (in a background thread when async): every
rank its files and shards, rank 0 the marker, the rename, `latest`, retention, the mirror. `save`, `load` and
`rollback_to` are collective: call them on every rank. `find_resume_checkpoint` picks what a run resumes from.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.checkpoint import atomic
from hybridflow.checkpoint.async_writer import (
    AsyncWriter,
    CheckpointWriteError,
    barrier,
    make_group,
    phase,
    rank_and_world,
)
from hybridflow.checkpoint.flatten import capture_rng_state, flatten_state, restore_rng_state, tensor_keys
from hybridflow.checkpoint.remote import RemoteMirror, is_remote_url, join_url
from hybridflow.checkpoint.storage import CpuStager, choose_format, damaged, read_component, write_component

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
EXTRA = "extra.json"
RANKS = "ranks"
PAYLOAD = "driver"  # the driver's tensors (e.g. rollouts generated ahead), written by rank 0
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


@dataclass
class LoadedCheckpoint:
    step: int
    path: Path
    components: dict[str, Any]
    extra: dict[str, Any]
    rank_state: dict[str, Any] | None  # this rank's `rank_state` as passed to save (None if absent)
    payload: Any = None  # the driver's payload as passed to save (rank 0 only; None if absent or not read)


def should_save(save_freq: int, step: int, is_last_step: bool) -> bool:
    """`trainer.checkpoint.save_freq`: 0 never; -1 only at the last step; k every k steps and at the last step."""
    return save_freq != 0 and (is_last_step or (save_freq > 0 and step % save_freq == 0))


def _rank_file(rank: int) -> str:
    return f"{RANKS}/rank_{rank:05d}.json"


class CheckpointManager:
    """Atomic, optionally async, checkpoint saving with retention, a remote mirror and safe loading."""

    def __init__(self, local_dir: str | os.PathLike, remote_dir: str | None = None, *, atomic_save: bool = True,
                 async_save: bool = True, keep_last_n: int | None = None, capture_rng: bool = True,
                 process_group: dist.ProcessGroup | None = None) -> None:
        if keep_last_n is not None and keep_last_n < 1:
            raise ValueError(f"trainer.checkpoint.keep_last_n={keep_last_n}: must be >= 1 or null")
        self.root = Path(local_dir)
        self.atomic, self.async_save, self.keep_last_n = atomic_save, async_save, keep_last_n
        self.capture_rng = capture_rng
        self.mirror = RemoteMirror(remote_dir) if remote_dir else None
        self._group = process_group if process_group is not None else make_group()
        self.rank, self.world_size = rank_and_world(self._group)
        self._writer, self._stager, self._protected = AsyncWriter(), CpuStager(), set[int]()
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            atomic.clean_stale(self.root)
        barrier(self._group)

    def protect(self, steps: Iterable[int]) -> None:
        """Steps retention must never delete (e.g. the best checkpoint for rollback); replaces the previous set."""
        self._protected = {int(s) for s in steps}

    # ------------------------------------------------------------------------------------------------- saving
    def save(self, step: int, components: Mapping[str, Mapping[str, Any]], extra: Mapping[str, Any] | None = None,
             rank_state: Mapping[str, Any] | None = None, payload: Mapping[str, Any] | None = None) -> Path:
        """Save `components` (name → nested state of tensors/DTensors and JSON scalars) as step `step`, with JSON
        `extra` (written once) and `rank_state` (per rank), and rank 0's `payload` (plain tensors and JSON, as
        `driver/`, in the same atomic commit). Returns the final directory (complete once `wait()` returns when
        async); raises `CheckpointWriteError` for a failure of this save (sync) or of the previous one (async)."""
        self._writer.wait()
        plan = {}
        for name, state in components.items():
            if not _NAME_RE.match(name) or name in (RANKS, PAYLOAD):
                raise ValueError(f"checkpoint component name {name!r}: use letters, digits, '_', '-', '.' "
                                 f"(and not {RANKS!r} or {PAYLOAD!r})")
            tensors, skeleton = flatten_state(state)
            plan[name] = (tensors, skeleton, choose_format(tensors))
        driver = None
        if payload is not None and self.rank == 0:
            tensors, skeleton = flatten_state(payload)
            if choose_format(tensors) != "safetensors":
                raise TypeError("the checkpoint's driver payload holds DTensors; give it plain (CPU) tensors")
            driver = ({k: t.to("cpu", copy=True) for k, t in tensors.items()}, skeleton)  # the caller goes on
        extra_text = _to_json(dict(extra or {}), "extra")
        rank_text = _to_json({"rng": capture_rng_state() if self.capture_rng else None,
                              "state": dict(rank_state) if rank_state is not None else None}, "rank_state")
        from hybridflow import __version__
        marker = {"format_version": FORMAT_VERSION, "step": int(step), "world_size": self.world_size,
                  "components": {n: {"format": fmt} for n, (_t, _s, fmt) in plan.items()}, "created_unix": time.time(),
                  "versions": {"hybridflow": __version__, "torch": torch.__version__,
                               "python": platform.python_version()}}
        if self.async_save:
            plan = {n: (self._stager.stage(t, prefix=n), s, f) for n, (t, s, f) in plan.items()}
        final = self.root / atomic.step_dirname(step)
        job = functools.partial(self._write, final, plan, extra_text, rank_text, marker, driver)
        if self.async_save:
            self._writer.submit(job, label=f"step {step} → {final}")
            return final
        try:
            job()
        except Exception as err:
            raise CheckpointWriteError(f"checkpoint save failed (step {step} → {final}): "
                                       f"{type(err).__name__}: {err}") from err
        return final

    def _write(self, final: Path, plan: dict[str, tuple[dict, dict, str]], extra_text: str, rank_text: str,
               marker: dict[str, Any], driver: tuple[dict, dict] | None) -> None:
        g, rank = self._group, self.rank
        work = atomic.tmp_path_for(final) if self.atomic else final
        phase("prepare", lambda: atomic.prepare_dir(final, self.atomic) if rank == 0 else None, g)

        def write_rank_files() -> None:
            path = work / _rank_file(rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(rank_text, encoding="utf-8")
            for name in plan:
                (work / name).mkdir(parents=True, exist_ok=True)

        phase("rank files", write_rank_files, g)
        for name, (tensors, skeleton, fmt) in plan.items():
            write = functools.partial(write_component, work / name, tensors, skeleton, fmt, rank, g)
            phase(f"component {name}", write, g)

        def finalize() -> None:
            if rank != 0:
                return
            missing = [r for r in range(self.world_size) if not (work / _rank_file(r)).is_file()]
            if missing:  # they wrote to their own node's disk: committing would publish a step without their shards
                raise RuntimeError(f"rank 0 does not see rank(s) {missing}'s files in {work}: {self.root} "
                                   "(trainer.default_local_dir) is not one directory every node shares; put it on a "
                                   "filesystem all nodes mount (NFS, a shared volume)")
            if driver is not None:
                write_component(work / PAYLOAD, driver[0], driver[1], "safetensors", 0, None)
            (work / EXTRA).write_text(extra_text, encoding="utf-8")
            atomic.commit_dir(work, final, marker, self.atomic)
            atomic.write_latest(self.root, final.name)
            logger.info("saved checkpoint %s", final)

        # Every rank fsyncs its own files before the vote, so rank 0's commit covers durable shards.
        phase("fsync", lambda: atomic.fsync_tree(work) if rank != 0 else None, g)
        phase("commit", finalize, g)
        if rank != 0:
            return
        self._retain(atomic.list_complete(self.root), atomic.remove_dir, keep=atomic.read_latest(self.root))
        if self.mirror is not None:
            try:
                self.mirror.upload(final)
            except Exception as err:
                raise RuntimeError(f"the local checkpoint {final} is complete, but mirroring it to "
                                   f"{self.mirror.base_url} failed: {err}") from err
            # The mirror keeps what local retention keeps; runs only once `final` is complete remotely.
            self._retain(self.mirror.list_complete(), self.mirror.delete, keep=final.name)

    def _retain(self, complete: list[tuple[int, Any]], remove: Callable[[Any], None], keep: str | None) -> None:
        """Delete all but the newest `keep_last_n` steps, the protected ones and the one named `keep`."""
        if self.keep_last_n is None:
            return
        kept = {s for s, _ in complete[-self.keep_last_n:]} | self._protected
        for step, where in complete:
            if step not in kept and Path(str(where)).name != keep:
                remove(where)

    def poll(self) -> None:
        """Non-blocking: raise `CheckpointWriteError` if the background save failed (call it every step)."""
        self._writer.poll()

    def wait(self) -> None:
        """Block until the in-flight save is complete; raise `CheckpointWriteError` if it failed."""
        self._writer.wait()

    def close(self) -> None:
        self._writer.wait()
        self._stager.clear()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ loading
    def load(self, path: str | os.PathLike | None = None, templates: Mapping[str, Mapping[str, Any]] | None = None,
             restore_rng: bool = True, with_payload: bool = True) -> LoadedCheckpoint:
        """Load a complete checkpoint (default: the latest local one). `templates` (component → the caller's state,
        e.g. DTensor shards) are filled in place, resharded; other components come back as full CPU tensors.
        Restores this rank's RNG unless `restore_rng=False`; rank 0 reads the payload unless `with_payload=False`."""
        self.wait()
        ckpt = Path(path) if path is not None else atomic.find_latest(self.root)
        if ckpt is None:
            raise FileNotFoundError(f"no complete checkpoint under {self.root}")
        if not atomic.is_complete(ckpt):
            raise ValueError(f"{ckpt} is not a complete hybridflow checkpoint (missing or invalid {atomic.MARKER}); "
                             "point trainer.resume_path at a global_step_<N> directory that finished saving")
        meta = atomic.read_json(ckpt / atomic.MARKER)
        if meta.get("format_version", 0) > FORMAT_VERSION:
            raise ValueError(f"{ckpt} was written with checkpoint format {meta['format_version']}; this hybridflow "
                             f"reads up to {FORMAT_VERSION} — upgrade hybridflow")
        templates = templates or {}
        unknown = sorted(set(templates) - set(meta["components"]))
        if unknown:
            raise KeyError(f"{ckpt} has no component(s) {unknown}; it holds {sorted(meta['components'])}")
        components = {}
        for name, info in meta["components"].items():
            flat = None
            if name in templates:
                flat, _ = flatten_state(templates[name])
                need = set(tensor_keys(_read_json(ckpt / name / "skeleton.json", ckpt)))
                missing = sorted(need - set(flat))
                if missing and info["format"] == "dcp":  # safetensors fills missing ones with fresh tensors
                    raise ValueError(f"{ckpt}/{name}: the template lacks tensors {missing[:5]}; build it from a "
                                     "sharded state with the same structure (e.g. optimizer state initialised, as "
                                     "DCP's get_state_dict does)")
                flat = {k: v for k, v in flat.items() if k in need}
            components[name] = read_component(ckpt / name, info["format"], flat, self._group)
        rank_path = ckpt / _rank_file(self.rank)
        saved = _read_json(rank_path, ckpt) if rank_path.exists() else {}
        if restore_rng and saved.get("rng") is not None:
            restore_rng_state(saved["rng"])
        if not saved and meta.get("world_size", 1) != self.world_size:
            logger.warning("%s was saved by %s ranks, now %s: rank %d starts with fresh RNG/rank state", ckpt,
                           meta.get("world_size"), self.world_size, self.rank)
        driver = None
        if with_payload and self.rank == 0 and (ckpt / PAYLOAD).is_dir():
            driver = read_component(ckpt / PAYLOAD, "safetensors", None, None)
        return LoadedCheckpoint(step=int(meta["step"]), path=ckpt, components=components,
                                extra=_read_json(ckpt / EXTRA, ckpt), rank_state=saved.get("state"), payload=driver)

    def rollback_to(self, step: int, templates: Mapping[str, Mapping[str, Any]] | None = None) -> LoadedCheckpoint:
        """Delete the checkpoints newer than `step` (local and remote: a crash after the rollback must not resume
        the abandoned branch), point `latest` at `step`, then load it (RNG not restored, so training does not
        replay the same samples). The caller applies the components to its engines and scales the LR if asked."""
        self.wait()
        if self.rank == 0:
            for s, path in atomic.list_complete(self.root):
                if s > step:
                    atomic.remove_dir(path)
            atomic.write_latest(self.root, atomic.step_dirname(step))
            for s, name in self.mirror.list_complete() if self.mirror is not None else []:
                if s > step:
                    self.mirror.delete(name)
        barrier(self._group)
        return self.load(self.root / atomic.step_dirname(step), templates=templates, restore_rng=False,
                         with_payload=False)


def _to_json(obj: dict[str, Any], what: str) -> str:
    try:
        return json.dumps(obj, indent=1, sort_keys=True)
    except (TypeError, ValueError) as err:
        raise TypeError(f"checkpoint {what} must be JSON (dicts of str/int/float/bool/None/lists): {err}") from err


def _read_json(path: Path, ckpt: Path) -> Any:
    try:
        return atomic.read_json(path)
    except (OSError, ValueError) as err:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise damaged(path, ckpt, err) from err


def find_resume_checkpoint(manager: CheckpointManager, mode: str, resume_path: str | None = None) -> Path | None:
    """The checkpoint directory to resume from per `trainer.resume_mode` (auto: the newest complete local one, else
    the newest remote one; path: `resume_path`, a directory or URL), or None to start fresh. A remote checkpoint is
    downloaded by rank 0 into the local root first, so loading has one code path. Collective when distributed."""
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
    fetch = manager.rank == 0 and not atomic.is_complete(target)
    if fetch:
        logger.info("no local copy of %s; downloading from %s", name, mirror.url(name))
    phase("download", lambda: mirror.download(name, manager.root) if fetch else None, manager._group)
    return target
