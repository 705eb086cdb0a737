"""Health signals over the metric stream: watermarks (slow generation, unstable update time, a validation metric
falling or NaN several times in a row, memory close to the device limit) and the non-finite step guard. The
`val_drop` warning and the guard's rollback request are the counts auto-rollback acts on.

Each check is a condition evaluated per step. A warning fires on the first unhealthy step of an *episode* and not
again until the condition has been healthy once (re-armed), so a persistent problem is one event, not one per step.
`health/<name>` counts the warnings fired so far. The first step that reports a timing is skipped by the timing
checks: it carries one-off warm-up (compilation, CUDA graph capture, cache allocation).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridflow.config.schema import HealthConfig

logger = logging.getLogger(__name__)

CHECKS = ("gen_time", "update_jitter", "val_drop", "memory")


@dataclass(frozen=True)
class HealthEvent:
    """One warning. `kind` is one of CHECKS; `val_drop` is the signal the trainer hands to rollback."""

    kind: str
    message: str
    step: int
    data: dict[str, Any] = field(default_factory=dict)
    level: str = "warning"


class HealthMonitor:
    """Evaluates the watermarks of `trainer.health` on each step's metrics; see the module docstring."""

    def __init__(self, health_cfg: HealthConfig, rollback_metric: str = "val/reward",
                 device_memory_gb: float | None = None, higher_is_better: bool = True) -> None:
        self.gen_time_warn_s = float(health_cfg.gen_time_warn_s)
        self.update_jitter_warn_s = float(health_cfg.update_jitter_warn_s)
        self.jitter_window = int(health_cfg.jitter_window)
        self.val_drop_patience = int(health_cfg.val_drop_patience)
        self.memory_warn_frac = float(health_cfg.memory_warn_frac)
        if self.jitter_window < 2:
            raise ValueError(f"trainer.health.jitter_window={self.jitter_window}: a std needs at least 2 steps; "
                             "set it to 2 or more")
        if self.val_drop_patience < 1:
            raise ValueError(f"trainer.health.val_drop_patience={self.val_drop_patience}: must be >= 1")
        self.val_metric = rollback_metric
        self.higher_is_better = higher_is_better  # a "fall" is a move the wrong way: down for a reward, up for a loss
        self.device_memory_gb = device_memory_gb if device_memory_gb is not None else detect_device_memory_gb()
        self.counts: dict[str, int] = dict.fromkeys(CHECKS, 0)
        self._armed: dict[str, bool] = dict.fromkeys(CHECKS, True)
        self._seen_timing: set[str] = set()
        self._update_times: deque[float] = deque(maxlen=self.jitter_window)
        self._val_history: list[float] = []
        self._val_drops = 0

    def metrics(self) -> dict[str, float]:
        """`health/<name>`: number of warnings of each kind fired so far."""
        return {f"health/{name}": float(n) for name, n in self.counts.items()}

    def check(self, metrics: dict[str, float], step: int) -> list[HealthEvent]:
        """Evaluate every watermark on this step's metrics; return the warnings that fire now."""
        found = {
            "gen_time": self._gen_time(metrics, step),
            "update_jitter": self._update_jitter(metrics, step),
            "val_drop": self._val_drop(metrics, step),
            "memory": self._memory(metrics, step),
        }
        events = []
        for name, result in found.items():
            if result is None:  # metric absent this step: state unchanged
                continue
            if result is False:
                self._armed[name] = True
            elif self._armed[name]:
                self._armed[name] = False
                self.counts[name] += 1
                events.append(result)
        return events

    def reset_val(self) -> None:
        """Forget the validation history (call after a rollback: the restored model starts a new comparison)."""
        self._val_history.clear()
        self._val_drops = 0
        self._armed["val_drop"] = True

    def val_state(self) -> dict[str, Any]:
        """The validation streak (JSON), saved with each checkpoint so a resumed run keeps counting."""
        return {"history": self._val_history, "drops": self._val_drops, "armed": self._armed["val_drop"]}

    def load_val_state(self, state: dict[str, Any]) -> None:
        self._val_history, self._val_drops = [float(v) for v in state["history"]], int(state["drops"])
        self._armed["val_drop"] = bool(state["armed"])

    # Each check returns None (not evaluated), False (healthy) or a HealthEvent (unhealthy).
    def _warmed_up(self, key: str, metrics: dict[str, float]) -> float | None:
        value = metrics.get(key)
        if value is None or not math.isfinite(value):
            return None
        if key not in self._seen_timing:
            self._seen_timing.add(key)
            return None
        return value

    def _gen_time(self, metrics: dict[str, float], step: int) -> HealthEvent | bool | None:
        value = self._warmed_up("timing/gen", metrics)
        if value is None:
            return None
        if value <= self.gen_time_warn_s:
            return False
        return HealthEvent("gen_time", (
            f"timing/gen={value:.2f}s is above trainer.health.gen_time_warn_s={self.gen_time_warn_s:g}s. "
            "Generation dominates the step: check data loading (data.num_workers, data.prefetch_factor), the "
            "tokenizer cache, and generation settings (data.max_response_length, rollout.n, rollout.max_num_seqs); "
            "raise the watermark if this speed is expected."), step,
            {"value": value, "threshold": self.gen_time_warn_s})

    def _update_jitter(self, metrics: dict[str, float], step: int) -> HealthEvent | bool | None:
        value = self._warmed_up("timing/update_actor", metrics)
        if value is None:
            return None
        self._update_times.append(value)
        if len(self._update_times) < self.jitter_window:
            return None
        std = statistics.pstdev(self._update_times)
        if std <= self.update_jitter_warn_s:
            return False
        return HealthEvent("update_jitter", (
            f"std of timing/update_actor over the last {self.jitter_window} steps is {std:.3f}s "
            f"(> trainer.health.update_jitter_warn_s={self.update_jitter_warn_s:g}s; mean "
            f"{statistics.fmean(self._update_times):.3f}s). Unstable update time: look for varying sequence "
            "lengths (data.use_packed_dataset, token-budget micro-batches), host-device syncs, GC pauses or a "
            "shared machine."), step, {"value": std, "threshold": self.update_jitter_warn_s})

    def _val_drop(self, metrics: dict[str, float], step: int) -> HealthEvent | bool | None:
        value = metrics.get(self.val_metric)
        if value is None:
            return None
        finite = [v for v in self._val_history if math.isfinite(v)]  # after a NaN, compare with the last number
        worse = finite and (value < finite[-1] if self.higher_is_better else value > finite[-1])
        if math.isnan(value) or worse:
            self._val_drops += 1
        else:
            self._val_drops = 0
        self._val_history = [*self._val_history[-self.val_drop_patience:], value]
        if self._val_drops < self.val_drop_patience:
            return False
        recent = self._val_history[-(self.val_drop_patience + 1):]
        trail = " → ".join(f"{v:.4g}" for v in recent)
        return HealthEvent("val_drop", (
            f"{self.val_metric} got worse {self._val_drops} validations in a row ({trail}); "
            "rollback takes over when trainer.rollback.enable=true."), step,
            {"value": value, "history": recent, "metric": self.val_metric, "falls": self._val_drops})

    def _memory(self, metrics: dict[str, float], step: int) -> HealthEvent | bool | None:
        value = metrics.get("perf/max_memory_allocated_gb")
        limit = metrics.get("perf/device_memory_gb", self.device_memory_gb)
        if value is None or not limit:
            return None
        frac = value / limit
        if frac < self.memory_warn_frac:
            return False
        return HealthEvent("memory", (
            f"perf/max_memory_allocated_gb={value:.1f} GiB is {frac:.0%} of the device's {limit:.1f} GiB "
            f"(trainer.health.memory_warn_frac={self.memory_warn_frac:g}). Close to OOM: lower the micro-batch token "
            "budget, enable gradient checkpointing or parameter/optimizer offload, or lower the rollout KV-cache "
            "fraction."), step, {"value": value, "limit": limit, "fraction": frac})


def detect_device_memory_gb() -> float | None:
    """Total memory of the current CUDA device in GiB (2^30 bytes, the unit of perf/max_memory_allocated_gb);
    None on CPU."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient norm."""


def _finite(x: Any) -> bool:
    """None, or a number, sequence or tensor of numbers that are all finite."""
    if x is None:
        return True
    flat = x.reshape(-1).tolist() if hasattr(x, "reshape") else list(x) if isinstance(x, (list, tuple)) else [x]
    return all(math.isfinite(float(v)) for v in flat)


class NonFiniteGuard:
    """Counts steps whose loss or grad norm is non-finite (the engines skipped their update); after
    `trainer.max_consecutive_bad_steps` in a row raises `NonFiniteError`, or, with rollback enabled, sets
    `rollback_requested` for the checkpoint policy to act on."""

    def __init__(self, max_consecutive_bad_steps: int, rollback_enabled: bool = False) -> None:
        if max_consecutive_bad_steps < 1:
            raise ValueError(f"trainer.max_consecutive_bad_steps={max_consecutive_bad_steps}: must be >= 1")
        self.max_bad, self.rollback_enabled = max_consecutive_bad_steps, rollback_enabled
        self.consecutive = self.skipped_total = 0
        self.rollback_requested = False

    def check(self, loss: Any = None, grad_norm: Any = None, step: int | None = None) -> bool:
        """True → a good step; False → a skipped one (counted). May raise `NonFiniteError`."""
        if _finite(loss) and _finite(grad_norm):
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.skipped_total += 1
        logger.warning("non-finite loss=%s or grad_norm=%s at step %s: skipping the optimizer step (%d in a row, "
                       "limit trainer.max_consecutive_bad_steps=%d)", _fmt(loss), _fmt(grad_norm), step,
                       self.consecutive, self.max_bad)
        if self.consecutive >= self.max_bad and self.rollback_enabled:
            self.rollback_requested, self.consecutive = True, 0
        elif self.consecutive >= self.max_bad:
            raise NonFiniteError(
                f"{self.max_bad} consecutive steps had a non-finite loss or gradient norm (last at step {step}; "
                f"{self.skipped_total} skipped in total). Training stopped. Lower the learning rate, check the "
                "data/rewards for inf/nan, enable trainer.rollback.enable=true to reload the best checkpoint, or "
                "raise trainer.max_consecutive_bad_steps.")
        return False

    def metrics(self) -> dict[str, float]:
        return {"train/skipped_steps": float(self.skipped_total), "train/consecutive_bad_steps": float(self.consecutive)}

    def state_dict(self) -> dict[str, int]:
        return {"consecutive": self.consecutive, "skipped_total": self.skipped_total}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consecutive, self.skipped_total = int(state["consecutive"]), int(state["skipped_total"])


def _fmt(x: Any) -> str:
    return str(x.reshape(-1)[:1].tolist() if hasattr(x, "reshape") else x)
