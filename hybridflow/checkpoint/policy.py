"""The driver's checkpoint policy, the same for every trainer: resume, a save every `trainer.checkpoint.save_freq`
steps, the non-finite guard and auto-rollback. The worker groups own the `CheckpointManager`s; one group (`""`)
writes under `trainer.default_local_dir`, several (roles in their own groups) under `<default_local_dir>/<name>`
and resume from the newest step every one has. A rollback restores weights, optimizer and LR schedule and hands
the checkpoint's `extra` to `on_rollback`; the data position and step counter move on (no replay)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hybridflow.checkpoint.manager import should_save
from hybridflow.checkpoint.recovery import RollbackDecision, RollbackTracker
from hybridflow.checkpoint.remote import join_url
from hybridflow.config import Config
from hybridflow.tracking.health import NonFiniteError, NonFiniteGuard

if TYPE_CHECKING:
    from hybridflow.checkpoint.worker import CheckpointingGroup
    from hybridflow.tracking import HealthEvent, Tracker

logger = logging.getLogger(__name__)


class CheckpointPolicy:
    """`groups`: name → the group that checkpoints; `guarded`: the metric namespaces whose `<ns>/loss`,
    `<ns>/grad_norm` and `<ns>/skipped` the guard reads; `extra()` (at each save) and `payload()` (tensors, written
    by the first group's rank 0) are the trainer's state, to which the policy adds its own."""

    def __init__(self, cfg: Config, groups: dict[str, CheckpointingGroup], guarded: tuple[str, ...],
                 tracker: Tracker | None = None,
                 on_rollback: Callable[[dict[str, Any]], None] | None = None,
                 payload: Callable[[], dict[str, Any] | None] | None = None) -> None:
        t = cfg.trainer
        self.cfg, self.guarded, self.tracker, self.on_rollback = cfg, guarded, tracker, on_rollback
        self.payload, self.targets = payload, groups
        if t.checkpoint.save_freq == 0 and t.resume_mode == "disable":
            self.targets = {}  # checkpointing off: no managers, no directories created
            if t.rollback.enable:
                logger.warning("trainer.rollback.enable=true is ignored with trainer.checkpoint.save_freq=0: "
                               "there is no checkpoint to roll back to")
        self.rollback = (RollbackTracker(t.rollback.lr_scale, t.rollback.max_rollbacks, t.rollback.metric,
                                         higher_is_better=t.rollback.higher_is_better())
                         if t.rollback.enable else None)
        self.health = tracker.health if tracker is not None else None  # counts the validation falls
        if self.rollback is not None and self.health is None:
            logger.warning("trainer.rollback.enable=true without a health monitor (no tracker): a falling "
                           "validation metric will not roll back, only trainer.max_consecutive_bad_steps will")
        self.guard = NonFiniteGuard(t.max_consecutive_bad_steps, rollback_enabled=t.rollback.enable)
        self.save_freq = t.checkpoint.save_freq
        self.last_saved: tuple[int, str] | None = None  # (step, path) of this run's newest save
        self.rollbacks: list[dict[str, Any]] = []  # one entry per rollback taken (also a tracker event)
        for subdir, group in self.targets.items():
            group.init_checkpoint(subdir or None)

    def resume(self) -> dict[str, Any] | None:
        """Load per `trainer.resume_mode` into the workers and restore the guard/rollback state; returns
        {"step", "path", "extra", "payload"} of the checkpoint (payload None when it has none), or None when
        starting fresh."""
        t = self.cfg.trainer
        if t.resume_mode == "disable" or not self.targets:
            return None
        infos = self._load(t.resume_mode, t.resume_path)
        if infos is None:
            return None
        steps = {name: info["step"] for name, info in infos.items()}
        if len(set(steps.values())) != 1:
            raise ValueError(f"trainer.resume_path={t.resume_path!r} holds different steps per role {steps}; point "
                             "it at a run directory whose roles were saved together")
        info = next(iter(infos.values()))
        for part, load in (("rollback", self.rollback and self.rollback.load_state_dict),
                           ("guard", self.guard.load_state_dict), ("health", self.health and self.health.load_val_state)):
            if load and info["extra"].get(part) is not None:
                load(info["extra"][part])
        return info

    def _load(self, mode: str, path: str | None) -> dict[str, dict[str, Any]] | None:
        if len(self.targets) == 1:
            info = next(iter(self.targets.values())).load_checkpoint(mode, path)[0]
            return None if info is None else {"": info}
        if mode == "path":
            assert path is not None, "validated by the config: resume_mode=path needs resume_path"
            infos = {name: g.load_checkpoint("path", join_url(path, name))[0] for name, g in self.targets.items()}
            return infos  # type: ignore[return-value]
        per_role = {name: set(g.checkpoint_steps()[0]) for name, g in self.targets.items()}
        common = set.intersection(*per_role.values())
        if not common:
            if any(per_role.values()):
                logger.warning("no checkpoint step is present for every role (%s); starting fresh",
                               {k: sorted(v) for k, v in per_role.items()})
            return None
        step = max(common)
        return {name: g.load_checkpoint(mode, step=step)[0] for name, g in self.targets.items()}

    def poll(self) -> None:
        """Raise the error of a failed background save now (CheckpointWriteError)."""
        for group in self.targets.values():
            group.poll_checkpoint()

    def check_finite(self, metrics: dict[str, float], step: int) -> dict[str, float]:
        """Count a step whose update the engines skipped (non-finite loss or grad norm); raises `NonFiniteError`
        after `trainer.max_consecutive_bad_steps` in a row, or rolls back when rollback is enabled."""
        losses = [metrics[f"{r}/loss"] for r in self.guarded if f"{r}/loss" in metrics]
        norms = [metrics[f"{r}/grad_norm"] for r in self.guarded if f"{r}/grad_norm" in metrics]
        if any(metrics.get(f"{r}/skipped", 0.0) > 0 for r in self.guarded):
            losses.append(float("nan"))  # the engine's verdict counts even where averaging hid the bad value
        self.guard.check(loss=losses or None, grad_norm=norms or None, step=step)
        if self.guard.rollback_requested:
            self.guard.rollback_requested = False
            reason = f"{self.guard.max_bad} consecutive non-finite steps"
            decision = self.rollback.decide(reason) if self.rollback is not None else None
            if decision is None:
                raise NonFiniteError(f"{reason} (last at step {step}) and no checkpoint to roll back to (or "
                                     "trainer.rollback.max_rollbacks reached). Training stopped.")
            self._roll_back(decision, step)
        return self.guard.metrics()

    def after_validation(self, val_metrics: dict[str, float], warnings: list[HealthEvent], step: int) -> None:
        """Score the next checkpoint by this validation; on the health monitor's `val_drop` warning (the metric
        fell `trainer.health.val_drop_patience` validations in a row) reload the best checkpoint."""
        if self.rollback is None:
            return
        self.rollback.observe(val_metrics)
        for w in warnings:
            if w.kind == "val_drop":
                reason = f"{w.data['metric']} got worse {w.data['falls']} validations in a row (now {w.data['value']:.6g})"
                decision = self.rollback.decide(reason)
                if decision is not None:
                    self._roll_back(decision, step)

    def _roll_back(self, decision: RollbackDecision, step: int) -> None:
        assert self.rollback is not None, "a rollback decision comes from the rollback tracker"
        extras = {name: g.rollback_checkpoint(decision.target_step, decision.lr_scale)[0]
                  for name, g in self.targets.items()}
        if self.on_rollback is not None:
            self.on_rollback(next(iter(extras.values())))
        self.guard.consecutive = 0
        if self.health is not None:
            self.health.reset_val()  # the restored model starts a new comparison
        taken = {"target_step": decision.target_step, "lr_scale": decision.lr_scale, "reason": decision.reason}
        if self.tracker is not None:
            self.tracker.event("rollback", f"reloaded checkpoint step {decision.target_step} at step {step}: "
                               f"{decision.reason}; lr x {decision.lr_scale:g} "
                               f"[{decision.rollback_index}/{self.rollback.max_rollbacks}]", step, level="warning",
                               **taken)
        self.rollbacks.append({"step": step, **taken})

    def maybe_save(self, step: int, is_last: bool, extra: Callable[[], dict[str, Any]]) -> None:
        """Save at `trainer.checkpoint.save_freq` (see `should_save`) with the trainer's `extra()` and this
        policy's own state."""
        if not self.targets or not should_save(self.save_freq, step, is_last):
            return
        if self.rollback is not None:
            self.rollback.on_checkpoint(step)
        self._save(step, extra)

    def save_final(self, step: int, extra: Callable[[], dict[str, Any]]) -> str | None:
        """Save `step` now, as the run ends early (a stop signal, data run out), unless it is saved already or
        checkpoints are off (`save_freq=0`); returns the checkpoint's path (None when nothing was saved)."""
        if not self.targets or self.save_freq == 0:
            return None
        if self.last_saved is None or self.last_saved[0] != step:
            self._save(step, extra)
        return None if self.last_saved is None else self.last_saved[1]

    def _save(self, step: int, extra: Callable[[], dict[str, Any]]) -> None:
        state = {**extra(), "rollback": self.rollback.state_dict() if self.rollback is not None else None,
                 "guard": self.guard.state_dict(), "health": self.health.val_state() if self.health else None}
        payload = self.payload() if self.payload is not None else None
        best = self.rollback.best_step if self.rollback is not None else None
        protect = [] if best is None else [best]  # retention keeps the rollback target
        paths = [group.save_checkpoint(step, state, protect, payload=payload if i == 0 else None)[0]
                 for i, group in enumerate(self.targets.values())]
        where = paths[0] if len(paths) == 1 else self.cfg.trainer.default_local_dir
        self.last_saved = (step, str(where))

    def close(self) -> None:
        """Wait for the last save (raising its error)."""
        for group in self.targets.values():
            group.close_checkpoints()
