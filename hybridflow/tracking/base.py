"""The backend interface every tracker implements, the `TRACKERS` registry, and shared helpers.

A backend is a small object with `log(metrics, step)`, `event(event)` and `close()`; `Tracker` fans out to a list
of them. Optional backends import their package inside `__init__` so a missing package only breaks that backend,
with one message that names the pip extra.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.utils.registry import Registry

logger = logging.getLogger(__name__)

TRACKING_EXTRA = "pip install 'hybridflow[tracking]'"


@dataclass(frozen=True)
class RunContext:
    """What every backend may need at construction: where to write and how to name the run."""

    run_dir: Path
    project: str = "hybridflow"
    experiment: str = "default"
    config: dict[str, Any] = field(default_factory=dict)  # resolved config as a plain nested dict
    log_every: int = 1


@dataclass(frozen=True)
class Event:
    """A discrete thing that happened (health warning, rollback, checkpoint ...) at a training step."""

    kind: str
    message: str
    step: int
    level: str = "info"  # info | warning | error
    data: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {"time": round(self.time, 3), "step": self.step, "kind": self.kind, "level": self.level,
                "message": self.message, **{k: to_jsonable(v) for k, v in self.data.items()}}


class Backend:
    """Base class: subclasses override what they support; `event` and `close` default to no-ops."""

    name = "base"

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def event(self, event: Event) -> None:  # noqa: B027 - optional hook, intentionally empty
        """Optional: record a discrete event. Backends without a natural place for events ignore them."""

    def close(self) -> None:  # noqa: B027 - optional hook, intentionally empty
        """Optional: flush and release resources."""


TRACKERS: Registry[type[Backend]] = Registry("tracker")


class MissingTrackerPackage(ImportError):
    """Raised when a tracker listed in `trainer.logger` needs a package that is not installed."""


def import_optional(module: str, tracker: str, package: str | None = None) -> Any:
    """Import `module` for tracker `tracker`, or raise one clear error naming the extra to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingTrackerPackage(
            f"trainer.logger lists {tracker!r} but the package {package or module!r} is not installed ({err}). "
            f"Install the tracking extra: {TRACKING_EXTRA} (or pip install {package or module}), "
            f"or remove {tracker!r} from trainer.logger."
        ) from err


def to_float(value: Any) -> float | None:
    """A metric value as a Python float; None for values that are not scalars (logged once, then dropped)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item):
        try:
            out = item()
        except (ValueError, RuntimeError):  # multi-element arrays/tensors have no single value
            return None
        return float(out) if isinstance(out, (int, float, bool)) else None
    return None


def clean_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """Keep scalar metrics as floats, drop (and report) the rest, so every backend sees the same values."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        f = to_float(value)
        if f is None:
            _warn_once(key, f"metric {key!r} has a non-scalar value of type {type(value).__name__}; not logged")
            continue
        out[str(key)] = f
    return out


def to_jsonable(value: Any) -> Any:
    """Non-finite floats become None (strict JSON); other scalars pass through; the rest become strings."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    f = to_float(value)
    if f is not None:
        return to_jsonable(f)
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    return str(value)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` → `{"a.b": 1}` (for backends with flat parameter tables such as mlflow)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, path))
        else:
            out[path] = value
    return out


_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message)
