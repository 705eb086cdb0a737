"""Auto-rollback: track the best checkpoint by a validation metric and decide when to reload it.

Each checkpoint is scored by the last validation value seen before it was saved. When the metric falls
(strictly worse than the previous validation) `patience` validations in a row, the tracker returns a
`RollbackDecision` for the best checkpoint, at most `max_rollbacks` times. The state is JSON for `extra`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

    from hybridflow.config.schema import RollbackConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RollbackDecision:
    target_step: int  # checkpoint step to reload
    lr_scale: float  # multiply the learning rate by this after reloading
    reason: str
    rollback_index: int  # 1 for the first rollback


class RollbackTracker:
    def __init__(self, patience: int = 3, lr_scale: float = 1.0, max_rollbacks: int = 3,
                 metric: str = "val/reward", higher_is_better: bool = True) -> None:
        if patience < 1:
            raise ValueError(f"trainer.rollback.patience={patience}: must be >= 1")
        if not lr_scale > 0:
            raise ValueError(f"trainer.rollback.lr_scale={lr_scale}: must be > 0")
        if max_rollbacks < 0:
            raise ValueError(f"trainer.rollback.max_rollbacks={max_rollbacks}: must be >= 0")
        self.patience, self.lr_scale, self.max_rollbacks = patience, lr_scale, max_rollbacks
        self.metric, self.higher_is_better = metric, higher_is_better
        self.last_value: float | None = None
        self.falls = 0
        self.rollbacks = 0
        self.ckpt_scores: dict[int, float] = {}  # checkpoint step → metric when it was saved
        self._warned_exhausted = False

    @classmethod
    def from_config(cls, rollback_cfg: RollbackConfig, higher_is_better: bool = True) -> RollbackTracker:
        return cls(rollback_cfg.patience, rollback_cfg.lr_scale, rollback_cfg.max_rollbacks, rollback_cfg.metric,
                   higher_is_better)

    def _better(self, a: float, b: float) -> bool:
        return a > b if self.higher_is_better else a < b

    @property
    def best_step(self) -> int | None:
        """Step of the best-scoring checkpoint (latest among ties), or None."""
        best: tuple[float, int] | None = None
        for step, score in sorted(self.ckpt_scores.items()):
            if best is None or not self._better(best[0], score):
                best = (score, step)
        return None if best is None else best[1]

    def on_checkpoint(self, step: int) -> None:
        """Record that a checkpoint was saved at `step` (scored by the latest validation value)."""
        if self.last_value is not None:
            self.ckpt_scores[int(step)] = self.last_value

    def forget_after(self, step: int) -> None:
        """Drop checkpoints newer than `step` (they are deleted by `CheckpointManager.discard_after`)."""
        self.ckpt_scores = {s: v for s, v in self.ckpt_scores.items() if s <= step}

    def observe(self, metrics: dict[str, Any]) -> RollbackDecision | None:
        """Feed one validation's metrics; returns a decision when a rollback should happen now."""
        if self.metric not in metrics:
            return None
        value = float(metrics[self.metric])
        fell = math.isnan(value) or (self.last_value is not None and self._better(self.last_value, value))
        self.falls = self.falls + 1 if fell else 0
        self.last_value = value
        if self.falls < self.patience:
            return None
        return self._decide(f"{self.metric} fell {self.falls} validations in a row (now {value:.6g})")

    def request(self, reason: str) -> RollbackDecision | None:
        """Ask for a rollback for another reason (e.g. too many non-finite steps); None if not possible."""
        return self._decide(reason)

    def _decide(self, reason: str) -> RollbackDecision | None:
        target = self.best_step
        if target is None:
            logger.warning("rollback wanted (%s) but no scored checkpoint exists; continuing", reason)
            return None
        if self.rollbacks >= self.max_rollbacks:
            if not self._warned_exhausted:
                logger.warning("rollback wanted (%s) but trainer.rollback.max_rollbacks=%d reached; continuing",
                               reason, self.max_rollbacks)
                self._warned_exhausted = True
            return None
        self.rollbacks += 1
        self.falls = 0
        self.last_value = self.ckpt_scores[target]
        self.forget_after(target)
        logger.warning("rolling back to checkpoint step %d (%s); lr x %g [%d/%d]", target, reason, self.lr_scale,
                       self.rollbacks, self.max_rollbacks)
        return RollbackDecision(target, self.lr_scale, reason, self.rollbacks)

    def state_dict(self) -> dict[str, Any]:
        return {"last_value": self.last_value, "falls": self.falls, "rollbacks": self.rollbacks,
                "ckpt_scores": {str(k): v for k, v in self.ckpt_scores.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_value = state["last_value"]
        self.falls = int(state["falls"])
        self.rollbacks = int(state["rollbacks"])
        self.ckpt_scores = {int(k): float(v) for k, v in state["ckpt_scores"].items()}


def scale_lr(optimizer: torch.optim.Optimizer, scheduler: LRScheduler | None, factor: float) -> None:
    """Multiply the learning rate by `factor` durably: param groups now, and the scheduler's base LRs, which
    LambdaLR-style schedulers recompute every step from (else the next `scheduler.step()` would undo it)."""
    for group in optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
