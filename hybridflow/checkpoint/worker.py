"""The registered save/load/rollback methods of every worker with a trained engine, and their driver-side handle.

One `CheckpointManager` per worker *process*: colocated roles (reached through `colocated_roles`, which
`ColocatedWorker` sets) write ONE checkpoint with one component per engine; a role in its own group
(`trainer.use_colocated_worker=false`) checkpoints only its engines, under its own sub-directory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from hybridflow.checkpoint import atomic
from hybridflow.checkpoint.manager import CheckpointManager, find_resume_checkpoint
from hybridflow.checkpoint.recovery import scale_lr
from hybridflow.checkpoint.remote import join_url
from hybridflow.config import Config
from hybridflow.controller import (
    Dispatch,
    DispatchContext,
    DispatchPlan,
    RoleGroup,
    per_rank,
    register,
    register_dispatch_mode,
)

if TYPE_CHECKING:
    from hybridflow.checkpoint.manager import LoadedCheckpoint
    from hybridflow.engine import TrainEngine

logger = logging.getLogger(__name__)

SAVE_DISPATCH = "checkpoint_save"


def _payload_to_rank_zero(ctx: DispatchContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> DispatchPlan:
    """ONE_TO_ALL, except `payload` (the driver's tensors), which only rank 0 writes and so only rank 0 receives."""
    rest = {k: v for k, v in kwargs.items() if k != "payload"}
    return DispatchPlan([args] * ctx.world_size,
                        [{**rest, "payload": kwargs.get("payload")}] + [rest] * (ctx.world_size - 1))


register_dispatch_mode(SAVE_DISPATCH, _payload_to_rank_zero, lambda ctx, outputs, state: list(outputs),
                       result="per_rank")


class CheckpointingWorker:
    """Mixin for role workers with trained engines. Subclasses override `checkpoint_engines` (component name →
    TrainEngine) and, for per-rank non-tensor state, `checkpoint_rank_state` / `load_checkpoint_rank_state`."""

    cfg: Config
    _ckpt: CheckpointManager | None = None

    def checkpoint_engines(self) -> dict[str, TrainEngine]:
        return {}

    def checkpoint_rank_state(self) -> dict[str, Any]:
        return {}

    def load_checkpoint_rank_state(self, state: dict[str, Any]) -> None:
        return None

    def _members(self) -> list[CheckpointingWorker]:
        """Every role in this process whose engines share this process's checkpoint (self first)."""
        roles = getattr(self, "colocated_roles", None) or {}
        others = [w for w in roles.values() if isinstance(w, CheckpointingWorker) and w is not self]
        return [self, *others]

    def _engines(self) -> dict[str, TrainEngine]:
        engines: dict[str, TrainEngine] = {}
        for member in self._members():
            for name, engine in member.checkpoint_engines().items():
                assert name not in engines, f"two colocated roles both checkpoint a component named {name!r}"
                engines[name] = engine
        return engines

    def _manager(self) -> CheckpointManager:
        assert self._ckpt is not None, "init_checkpoint() builds the manager before any save or load"
        return self._ckpt

    def _apply(self, load: Callable[[dict[str, Any]], LoadedCheckpoint]) -> LoadedCheckpoint:
        """Load through `load(templates)` into every engine of this process (they re-offload themselves)."""
        engines = self._engines()
        loaded = load({name: engine.state_dict() for name, engine in engines.items()})
        for name, engine in engines.items():
            engine.load_state_dict(loaded.components[name])
        return loaded

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_checkpoint(self, subdir: str | None = None) -> None:
        """Build this process's CheckpointManager (collective). `subdir` (e.g. "critic") gives a role in its own
        group its own root under `trainer.default_local_dir` (and `default_hdfs_dir`)."""
        t = self.cfg.trainer
        local, remote = t.default_local_dir, t.default_hdfs_dir
        if subdir:
            local = f"{local.rstrip('/')}/{subdir}"
            remote = join_url(remote, subdir) if remote else None
        self._ckpt = CheckpointManager(local, remote, atomic_save=t.checkpoint.atomic_save,
                                       async_save=t.checkpoint.async_save, keep_last_n=t.checkpoint.keep_last_n)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def checkpoint_steps(self) -> list[int]:
        """Steps of the complete checkpoints under this root, local or in the remote mirror."""
        mgr = self._manager()
        steps = {s for s, _ in atomic.list_complete(mgr.root)}
        if mgr.mirror is not None:
            steps |= {s for s, _ in mgr.mirror.list_complete()}
        return sorted(steps)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, mode: str, path: str | None = None, step: int | None = None) -> dict[str, Any] | None:
        """Resume per `mode` (auto|disable|path, as `trainer.resume_mode`) or at exactly `step` (local copy, else
        downloaded from the mirror). Returns {"step", "path", "extra", "payload"} (the driver's payload: rank 0's,
        None elsewhere or when the checkpoint has none) or None when there is nothing to load."""
        mgr = self._manager()
        if step is not None:
            name = atomic.step_dirname(step)
            local = mgr.root / name
            mode, path = "path", str(local) if atomic.is_complete(local) or mgr.mirror is None else mgr.mirror.url(name)
        found = find_resume_checkpoint(mgr, mode, path)
        if found is None:
            return None
        loaded = self._apply(lambda templates: mgr.load(found, templates=templates))
        for member in self._members():
            member.load_checkpoint_rank_state(loaded.rank_state or {})
        logger.info("rank %d: loaded checkpoint %s (components %s)", getattr(self, "rank", 0), loaded.path,
                    sorted(loaded.components))
        return {"step": loaded.step, "path": str(loaded.path), "extra": loaded.extra, "payload": loaded.payload}

    @register(dispatch_mode=SAVE_DISPATCH)
    def save_checkpoint(self, step: int, extra: dict[str, Any], protect: list[int],
                        payload: dict[str, Any] | None = None) -> str:
        """Save every engine of this process as step `step` with the driver's JSON `extra` (async per config) and,
        on rank 0, the driver's `payload` (tensors and JSON, pass it by keyword: the other ranks do not get it);
        retention never deletes the steps in `protect` (the best checkpoint for rollback)."""
        self._manager().protect(protect)
        engines = self._engines()
        components = {name: engine.state_dict() for name, engine in engines.items()}
        rank_state = {k: v for member in self._members() for k, v in member.checkpoint_rank_state().items()}
        path = self._manager().save(step, components, extra=extra, rank_state=rank_state, payload=payload)
        for engine in engines.values():
            # state_dict() brings offloaded params/optimizer onto the device; async saves have already staged
            # them to CPU memory and sync saves have written them, so put them back where they rest.
            engine.to_rest()
        return str(path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollback_checkpoint(self, step: int, lr_scale: float = 1.0) -> dict[str, Any]:
        """Discard checkpoints after `step`, reload `step` into the engines (RNG kept), scale the LR of every
        trained engine by `lr_scale`; returns the checkpoint's `extra`."""
        loaded = self._apply(lambda templates: self._manager().rollback_to(step, templates=templates))
        if lr_scale != 1.0:
            for engine in self._engines().values():
                if engine.optimizer is not None:
                    scale_lr(engine.optimizer, engine.lr_scheduler, lr_scale)
        return loaded.extra

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def poll_checkpoint(self) -> None:
        """Raise here if the background save failed (CheckpointWriteError)."""
        self._manager().poll()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def close_checkpoints(self) -> None:
        """Wait for the in-flight save (raising its error) and release the staging memory."""
        if self._ckpt is not None:
            self._ckpt.close()


class CheckpointingGroup(RoleGroup):
    """Driver-side handle of the checkpoint methods above (the base of the trained roles' handles)."""

    worker_cls: ClassVar[type] = CheckpointingWorker
    init_checkpoint = per_rank(CheckpointingWorker.init_checkpoint)
    checkpoint_steps = per_rank(CheckpointingWorker.checkpoint_steps)
    load_checkpoint = per_rank(CheckpointingWorker.load_checkpoint)
    save_checkpoint = per_rank(CheckpointingWorker.save_checkpoint)
    rollback_checkpoint = per_rank(CheckpointingWorker.rollback_checkpoint)
    poll_checkpoint = per_rank(CheckpointingWorker.poll_checkpoint)
    close_checkpoints = per_rank(CheckpointingWorker.close_checkpoints)
