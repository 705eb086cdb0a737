"""`Tracker`: the one object the trainer talks to. It fans each call out to the backends in `trainer.logger`.

`jsonl` is always on (it feeds `hybridflow report`). With a `HealthMonitor` attached, `log` also evaluates the
watermarks, adds `health/*` counters to the logged metrics, emits each warning as an event and returns the
warnings (the trainer hands a `val_drop` to rollback). A backend that fails while logging is reported once and
disabled, so a tracker outage never kills a long run; `jsonl` failures are raised.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hybridflow.config.schema import Config
from hybridflow.tracking import console as _console  # noqa: F401 - registers "console"
from hybridflow.tracking import jsonl as _jsonl  # noqa: F401 - registers "jsonl"
from hybridflow.tracking import mlflow as _mlflow  # noqa: F401 - registers "mlflow"
from hybridflow.tracking import swanlab as _swanlab  # noqa: F401 - registers "swanlab"
from hybridflow.tracking import tensorboard as _tensorboard  # noqa: F401 - registers "tensorboard"
from hybridflow.tracking import wandb as _wandb  # noqa: F401 - registers "wandb"
from hybridflow.tracking.base import TRACKERS, Backend, Event, RunContext, clean_metrics
from hybridflow.tracking.console import ConsoleBackend
from hybridflow.tracking.health import HealthEvent, HealthMonitor
from hybridflow.tracking.run_info import config_to_dict, summary, write_run_info
from hybridflow.tracking.summary import TOTAL_STEPS

logger = logging.getLogger(__name__)

ALWAYS_ON = ("jsonl",)


class Tracker:
    """Fan-out over backends, plus progress display and optional health checks."""

    def __init__(self, backends: Sequence[Backend], run_dir: str | Path, health: HealthMonitor | None = None) -> None:
        self.backends = list(backends)
        self.run_dir = Path(run_dir)
        self.health = health
        self._closed = False
        self._last_step = 0
        self.total_steps: int | None = None  # the run's step count, once `start_progress` is called
        self._console = next((b for b in self.backends if isinstance(b, ConsoleBackend)), None)

    # ------------------------------------------------------------------------------------------ building
    @classmethod
    def from_config(cls, cfg: Config, run_dir: str | Path | None = None, write_info: bool = True,
                    **backend_kwargs: Any) -> Tracker:
        """Tracker for a `hybridflow.config.Config`: backends from `trainer.logger`, a HealthMonitor from
        `trainer.health` (val metric `trainer.rollback.metric`); writes config.yaml + versions.json to the run
        directory and records a `run_start` event. `backend_kwargs` as for `build_tracker`
        (e.g. `console={"verbose": True}`)."""

        t = cfg.trainer
        run_dir = Path(run_dir if run_dir is not None else t.run_dir)
        config_dict = config_to_dict(cfg)
        info = write_run_info(run_dir, cfg) if write_info else None
        health = HealthMonitor(t.health, rollback_metric=t.rollback.metric,
                               higher_is_better=t.rollback.higher_is_better())
        tracker = build_tracker(t.logger, run_dir, t.project_name, t.experiment_name, config_dict, t.log_every,
                                health=health, **backend_kwargs)
        if info is not None:
            tracker.event("run_start", summary(info), step=0, git_commit=info["git_commit"])
        return tracker

    # ------------------------------------------------------------------------------------------ logging
    def log(self, metrics: dict[str, Any], step: int) -> list[HealthEvent]:
        """Log one step's metrics to every backend; returns the health warnings fired at this step."""
        clean = clean_metrics(metrics)
        if self.total_steps is not None:  # so the report's header and the summary know the run's own step count
            clean[TOTAL_STEPS] = float(self.total_steps)
        self._last_step = int(step)
        warnings: list[HealthEvent] = []
        if self.health is not None:
            warnings = self.health.check(clean, step)
            clean.update(self.health.metrics())
        for w in warnings:
            self.event(w.kind, w.message, step, level=w.level, **w.data)
        self._fan_out("log", clean, step)
        return warnings

    def event(self, kind: str, message: str, step: int, level: str = "info", **data: Any) -> None:
        """Record a discrete event (events.jsonl, console, backends that keep events)."""
        ev = Event(kind=kind, message=message, step=int(step), level=level, data=data)
        if self._console is None:  # no console backend: make sure a human still sees it
            logger.log(logging.WARNING if level in ("warning", "error") else logging.INFO,
                       "%s (step %d): %s", kind, step, message)
        self._fan_out("event", ev)

    # ------------------------------------------------------------------------------------------ progress
    def start_progress(self, total_steps: int, initial_step: int = 0) -> None:
        """Show a progress bar (TTY) / add `step N/total, eta` to plain lines; it follows `log(step)` calls. Rows
        logged from now on carry `training/total_steps`."""
        self.total_steps = int(total_steps)
        if self._console is not None:
            self._console.start_progress(total_steps, initial_step)

    def advance(self, step: int) -> None:
        """Move the bar to `step` without logging metrics (e.g. skipped steps)."""
        if self._console is not None:
            self._console.update_progress(step)

    def stop_progress(self) -> None:
        if self._console is not None:
            self._console.stop_progress()

    @contextlib.contextmanager
    def progress(self, total_steps: int, initial_step: int = 0) -> Iterator[Tracker]:
        self.start_progress(total_steps, initial_step)
        try:
            yield self
        finally:
            self.stop_progress()

    # ------------------------------------------------------------------------------------------ lifecycle
    def close(self, status: str | None = None, error: BaseException | None = None) -> None:
        """Record a `run_end` event, then close every backend. Idempotent. The status is `run_status(error)` unless
        given: `finished` | `failed` | `interrupted`; a failure adds the error's type and message, and a worker
        group's failure its `group`, `method` and `rank` (the report shows the status)."""
        if self._closed:
            return
        status = status or run_status(error)
        self.stop_progress()
        data = error_fields(error) if error is not None else {}
        message = f"run {status} at step {self._last_step}"
        if error is not None:
            message += f": {data['error_type']}: {data['error'].splitlines()[0] if data['error'] else ''}"
        self.event("run_end", message, self._last_step, level="info" if status == "finished" else "error",
                   status=status, **data)
        self._closed = True
        for backend in self.backends:
            try:
                backend.close()
            except Exception:  # one backend failing to flush must not stop the others from closing
                logger.exception("tracker %r failed to close", backend.name)

    def truncate_after(self, step: int) -> None:
        """A run resumed at `step` into this run directory: drop what the backends logged for later steps (the
        resumed run logs them again), so each step appears once."""
        self._last_step = int(step)
        for backend in self.backends:
            truncate = getattr(backend, "truncate_after", None)
            if truncate is not None:
                truncate(step)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close(error=exc)

    def _fan_out(self, method: str, *args: Any) -> None:
        for backend in list(self.backends):
            try:
                getattr(backend, method)(*args)
            except Exception:
                if backend.name in ALWAYS_ON:
                    raise
                logger.exception("tracker %r failed in %s(); disabling it for the rest of the run",
                                 backend.name, method)
                self.backends.remove(backend)
                if backend is self._console:
                    self._console = None


def run_status(error: BaseException | None) -> str:
    """`finished` without an error, `interrupted` for Ctrl-C or SIGTERM (a `KeyboardInterrupt`), else `failed`."""
    if error is None:
        return "finished"
    return "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"


def error_fields(error: BaseException) -> dict[str, Any]:
    """The `run_end` fields of an error: type and message, plus group/method/rank (and node, stage when known) of a
    worker-group failure."""
    fields: dict[str, Any] = {"error_type": type(error).__name__, "error": str(error)[:2000]}
    for key in ("group", "method", "rank", "node", "stage"):  # WorkerError & co. (duck-typed: no controller import)
        value = getattr(error, key, None)
        if isinstance(value, int) or (isinstance(value, str) and value):
            fields[key] = value
    return fields


def build_tracker(logger_names: Sequence[str], run_dir: str | Path, project: str = "hybridflow",
                  experiment: str = "default", config_dict: dict[str, Any] | None = None, log_every: int = 1,
                  health: HealthMonitor | None = None, **backend_kwargs: Any) -> Tracker:
    """Tracker with one backend per name in `logger_names` (plus `jsonl`, always on), in that order.

    `backend_kwargs` maps a backend name to extra constructor kwargs, e.g. `console={"stream": buf, "tty": False}`.
    """
    if isinstance(logger_names, str):
        logger_names = [logger_names]
    unknown = [n for n in logger_names if n not in TRACKERS]
    if unknown:
        raise ValueError(f"trainer.logger contains unknown tracker(s) {unknown}; choose from "
                         f"{', '.join(TRACKERS.names())}, e.g. trainer.logger=[console,tensorboard]")
    names = list(dict.fromkeys([*ALWAYS_ON, *logger_names]))
    ctx = RunContext(run_dir=Path(run_dir), project=project, experiment=experiment, config=config_dict or {},
                     log_every=log_every)
    backends: list[Backend] = []
    try:
        for name in names:
            backends.append(TRACKERS[name](ctx, **backend_kwargs.get(name, {})))
    except BaseException:
        for b in backends:
            b.close()
        raise
    return Tracker(backends, run_dir, health=health)
