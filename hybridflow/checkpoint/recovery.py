"""Auto-rollback: score each checkpoint by the last validation value seen before it was saved, and pick the best
when a health signal asks (`hybridflow.tracking.health`: the monitor's `val_drop` warning, or the non-finite
guard's request), at most `trainer.rollback.max_rollbacks` times. Counting is the signals' job, not this one's.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RollbackDecision:
    target_step: int  # checkpoint step to reload
    lr_scale: float  # multiply the learning rate by this after reloading
    reason: str
    rollback_index: int  # 1 for the first rollback


class RollbackTracker:
    def __init__(self, lr_scale: float = 1.0, max_rollbacks: int = 3, metric: str = "val/reward",
                 higher_is_better: bool = True) -> None:
        if not lr_scale > 0:
            raise ValueError(f"trainer.rollback.lr_scale={lr_scale}: must be > 0")
        if max_rollbacks < 0:
            raise ValueError(f"trainer.rollback.max_rollbacks={max_rollbacks}: must be >= 0")
        self.lr_scale, self.max_rollbacks, self.metric = lr_scale, max_rollbacks, metric
        self.sign = 1.0 if higher_is_better else -1.0  # scores compared as sign × value: higher is better
        self.last_value: float | None = None
        self.rollbacks, self._warned_exhausted = 0, False
        self.ckpt_scores: dict[int, float] = {}  # checkpoint step → metric when it was saved

    @property
    def best_step(self) -> int | None:
        """Step of the best-scoring checkpoint (latest among ties; `trainer.rollback.mode` says which way), or None."""
        best: tuple[float, int] | None = None
        for step, score in sorted(self.ckpt_scores.items()):
            if not math.isfinite(score):  # a diverged checkpoint (NaN validation) is never a rollback target
                continue
            if best is None or not best[0] > self.sign * score:
                best = (self.sign * score, step)
        return None if best is None else best[1]

    def observe(self, metrics: dict[str, Any]) -> None:
        """Remember this validation's value of the metric (it scores the next checkpoint)."""
        if self.metric in metrics:
            self.last_value = float(metrics[self.metric])

    def on_checkpoint(self, step: int) -> None:
        """Record that a checkpoint was saved at `step` (scored by the latest validation value)."""
        if self.last_value is not None:
            self.ckpt_scores[int(step)] = self.last_value

    def decide(self, reason: str) -> RollbackDecision | None:
        """The checkpoint to reload now, or None (no scored checkpoint, or `max_rollbacks` reached)."""
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
        self.last_value = self.ckpt_scores[target]
        self.ckpt_scores = {s: v for s, v in self.ckpt_scores.items() if s <= target}  # the abandoned branch
        logger.warning("rolling back to checkpoint step %d (%s); lr x %g [%d/%d]", target, reason, self.lr_scale,
                       self.rollbacks, self.max_rollbacks)
        return RollbackDecision(target, self.lr_scale, reason, self.rollbacks)

    def state_dict(self) -> dict[str, Any]:
        return {"last_value": self.last_value, "rollbacks": self.rollbacks,
                "ckpt_scores": {str(k): v for k, v in self.ckpt_scores.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_value, self.rollbacks = state["last_value"], int(state["rollbacks"])
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
