"""Driver side of checkpointing for the PPO/GRPO trainer: resume, periodic saves, auto-rollback, NaN guard.

The worker groups own the `CheckpointManager`s (one per worker process, see `hybridflow.workers.checkpointing`):
colocated roles write one checkpoint under `trainer.default_local_dir`; roles in their own groups write under
`<default_local_dir>/<role>` and resume from the newest step present for every role. The driver adds the JSON
`extra` (config, data position, KL controller, rollback/guard state). A rollback restores weights, optimizer,
LR schedule and KL controller; the data position and step counter move on (no replay of the same batches).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from hybridflow.checkpoint import (
    DataPosition,
    NonFiniteError,
    NonFiniteGuard,
    RollbackDecision,
    RollbackTracker,
    join_url,
)
from hybridflow.config import Config, to_dict

if TYPE_CHECKING:
    from hybridflow.trainer.ppo import PPOTrainer
    from hybridflow.workers.checkpointing import CheckpointingGroup

logger = logging.getLogger(__name__)

TRAINED_ROLES = ("actor", "critic")


class TrainerCheckpointing:
    """Owns the checkpoint/rollback/NaN-guard policy of one `PPOTrainer` (passed in, read and updated)."""

    def __init__(self, trainer: PPOTrainer) -> None:
        self.trainer = trainer
        cfg: Config = trainer.cfg
        t = cfg.trainer
        self.cfg = cfg
        self.targets: dict[str, CheckpointingGroup]
        groups = trainer.groups
        if t.checkpoint.save_freq == 0 and t.resume_mode == "disable":
            self.targets = {}  # checkpointing off: no managers, no directories created
            if t.rollback.enable:
                logger.warning("trainer.rollback.enable=true is ignored with trainer.checkpoint.save_freq=0: "
                               "there is no checkpoint to roll back to")
        elif t.use_colocated_worker or groups.critic is None:
            self.targets = {"": groups.actor}  # one checkpoint for every role of the process
        else:
            self.targets = {"actor": groups.actor, "critic": groups.critic}
        self.rollback = RollbackTracker.from_config(t.rollback) if t.rollback.enable else None
        self.guard = NonFiniteGuard(t.max_consecutive_bad_steps, rollback_enabled=t.rollback.enable)
        self.save_freq = t.checkpoint.save_freq
        self.rollbacks: list[dict[str, Any]] = []  # one entry per rollback taken (also a tracker event)
        for subdir, group in self.targets.items():
            group.init_checkpoint(subdir or None)

    # ------------------------------------------------------------------------------------------------ resume
    def resume(self) -> bool:
        """Load per `trainer.resume_mode`; restores engines (workers) and the driver state. True if resumed."""
        t = self.cfg.trainer
        if t.resume_mode == "disable" or not self.targets:
            return False
        infos = self._load(t.resume_mode, t.resume_path)
        if infos is None:
            return False
        steps = {name: info["step"] for name, info in infos.items()}
        if len(set(steps.values())) != 1:
            raise ValueError(f"trainer.resume_path={t.resume_path!r} holds different steps per role {steps}; point "
                             "it at a run directory whose roles were saved together")
        info = next(iter(infos.values()))
        self._apply_extra(info["extra"])
        logger.info("resumed from %s at step %d (epoch %d, batch %d of %d)", info["path"], self.trainer.global_step,
                    self.trainer.epoch, self.trainer.loader.batch_in_epoch, len(self.trainer.loader))
        return True

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

    def _apply_extra(self, extra: dict[str, Any]) -> None:
        tr = self.trainer
        ema_saved, ema_now = bool(extra.get("ema", {}).get("enable", False)), self.cfg.ref.ema.enable
        if ema_saved != ema_now:
            raise ValueError(f"the checkpoint was saved with ref.ema.enable={ema_saved} but now ref.ema.enable="
                             f"{ema_now}; resume with the same setting (or trainer.resume_mode=disable)")
        tr.global_step = int(extra["global_step"])
        pos = DataPosition.from_dict(extra["data"], len(tr.loader))
        tr.loader.load_state_dict({**extra["loader"], "epoch": pos.epoch, "batch_in_epoch": pos.batch})
        tr.epoch = tr.loader.epoch
        tr.kl_ctrl.load_state_dict(extra["kl_ctrl"])
        tr._gen_calls = int(extra.get("gen_calls", 0))  # noqa: SLF001 — part of the sampling seeds
        if self.rollback is not None and extra.get("rollback") is not None:
            self.rollback.load_state_dict(extra["rollback"])
        self.guard.load_state_dict(extra["guard"])

    # -------------------------------------------------------------------------------------------- each step
    def poll(self) -> None:
        """Raise the error of a failed background save now (CheckpointWriteError)."""
        for group in self.targets.values():
            group.poll_checkpoint()

    def check_finite(self, metrics: dict[str, float], step: int) -> dict[str, float]:
        """Count a step whose update the engines skipped (non-finite loss or grad norm); raises `NonFiniteError`
        after `trainer.max_consecutive_bad_steps` in a row, or rolls back when rollback is enabled."""
        losses = [metrics[f"{r}/loss"] for r in TRAINED_ROLES if f"{r}/loss" in metrics]
        norms = [metrics[f"{r}/grad_norm"] for r in TRAINED_ROLES if f"{r}/grad_norm" in metrics]
        if any(metrics.get(f"{r}/skipped", 0.0) > 0 for r in TRAINED_ROLES):
            losses.append(float("nan"))  # the engine's verdict counts even where averaging hid the bad value
        self.guard.check(loss=torch.tensor(losses) if losses else None,
                         grad_norm=torch.tensor(norms) if norms else None, step=step)
        if self.guard.rollback_requested:
            self.guard.rollback_requested = False
            reason = f"{self.guard.max_bad} consecutive non-finite steps"
            decision = self.rollback.request(reason) if self.rollback is not None else None
            if decision is None:
                raise NonFiniteError(f"{reason} (last at step {step}) and no checkpoint to roll back to (or "
                                     "trainer.rollback.max_rollbacks reached). Training stopped.")
            self._roll_back(decision, step)
        return self.guard.metrics()

    def after_validation(self, val_metrics: dict[str, float], step: int) -> None:
        """Feed the rollback tracker; reload the best checkpoint when the metric kept falling."""
        if self.rollback is None:
            return
        decision = self.rollback.observe(val_metrics)
        if decision is not None:
            self._roll_back(decision, step)

    def _roll_back(self, decision: RollbackDecision, step: int) -> None:
        extras = {name: g.rollback_checkpoint(decision.target_step, decision.lr_scale)[0]
                  for name, g in self.targets.items()}
        extra = next(iter(extras.values()))
        self.trainer.kl_ctrl.load_state_dict(extra["kl_ctrl"])
        self.guard.consecutive = 0
        tracker = self.trainer.tracker
        if tracker is not None:
            tracker.event("rollback", f"reloaded checkpoint step {decision.target_step} at step {step}: "
                          f"{decision.reason}; lr x {decision.lr_scale:g} "
                          f"[{decision.rollback_index}/{self.rollback.max_rollbacks}]", step, level="warning",
                          target_step=decision.target_step, lr_scale=decision.lr_scale, reason=decision.reason)
            if getattr(tracker, "health", None) is not None:
                tracker.health.reset_val()
        self.rollbacks.append({"step": step, "target_step": decision.target_step,
                                             "lr_scale": decision.lr_scale, "reason": decision.reason})

    def should_save(self, step: int, is_last: bool) -> bool:
        """save_freq semantics (CheckpointManager.should_save): 0 never; -1 at the last step; k every k + last."""
        if self.save_freq == 0:
            return False
        return is_last or (self.save_freq > 0 and step % self.save_freq == 0)

    def maybe_save(self, step: int, is_last: bool) -> None:
        if not self.should_save(step, is_last):
            return
        if self.rollback is not None:
            self.rollback.on_checkpoint(step)
            best = self.rollback.best_step
            for group in self.targets.values():
                group.protect_checkpoints([] if best is None else [best])
        extra = self._extra(step)
        for group in self.targets.values():
            group.save_checkpoint(step, extra)

    def _extra(self, step: int) -> dict[str, Any]:
        tr, ema = self.trainer, self.cfg.ref.ema
        return {
            "config": to_dict(self.cfg),
            "global_step": int(step),
            "data": DataPosition(tr.loader.epoch, tr.loader.batch_in_epoch).to_dict(),
            "loader": tr.loader.state_dict(),
            "kl_ctrl": tr.kl_ctrl.state_dict(),
            "gen_calls": int(tr._gen_calls),  # noqa: SLF001 — the driver's sampling seeds count generate calls
            "ema": {"enable": ema.enable, "decay": ema.decay, "update_every": ema.update_every},
            "rollback": self.rollback.state_dict() if self.rollback is not None else None,
            "guard": self.guard.state_dict(),
        }

    def close(self) -> None:
        """Wait for the last save (raising its error)."""
        for group in self.targets.values():
            group.close_checkpoints()
