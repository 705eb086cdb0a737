"""Always-on JSON-lines log: `metrics.jsonl` (one object per `log` call) and `events.jsonl` in the run directory.

These files are the source of truth for `hybridflow report`. Each line is flushed as soon as it is written, so a
report can be drawn from a run that is still going; the readers skip a half-written last line. Files are opened
for append so a resumed run continues the same log: on resume, `truncate_after(step)` first drops the rows and
per-step events the killed run wrote after the checkpoint it resumes from, so each step appears once.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridflow.tracking.base import TRACKERS, Backend, Event, RunContext, to_jsonable

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
RUN_EVENTS = ("run_start", "run_end", "resume")  # the history of attempts: kept by `truncate_after`


@TRACKERS.register("jsonl")
class JsonlBackend(Backend):
    """Appends `{"step": s, "time": t, **metrics}` to metrics.jsonl and events to events.jsonl."""

    name = "jsonl"

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = ctx.run_dir / METRICS_FILE
        self.events_path = ctx.run_dir / EVENTS_FILE
        self._metrics_fh = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115 - held for the run
        self._events_fh = open(self.events_path, "a", encoding="utf-8")  # noqa: SIM115

    def log(self, metrics: dict[str, float], step: int) -> None:
        import time

        row: dict[str, Any] = {"step": int(step), "time": round(time.time(), 3)}
        row.update({k: to_jsonable(v) for k, v in metrics.items()})
        self._metrics_fh.write(json.dumps(row, allow_nan=False) + "\n")
        self._metrics_fh.flush()

    def event(self, event: Event) -> None:
        self._events_fh.write(json.dumps(event.to_dict(), allow_nan=False) + "\n")
        self._events_fh.flush()

    def close(self) -> None:
        for fh in (self._metrics_fh, self._events_fh):
            if not fh.closed:
                fh.close()

    def truncate_after(self, step: int) -> None:
        """Drop metric rows and per-step events of steps after `step` (a resume from that step's checkpoint);
        run start/end events stay, so the earlier attempts remain visible. Logs what it dropped."""
        self.close()
        dropped_rows = _rewrite(self.metrics_path, lambda row: int(row.get("step", 0)) <= step)
        dropped_events = _rewrite(self.events_path, lambda ev: int(ev.get("step", 0)) <= step
                                  or ev.get("kind") in RUN_EVENTS)
        self._metrics_fh = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115 - held for the run
        self._events_fh = open(self.events_path, "a", encoding="utf-8")  # noqa: SIM115
        if dropped_rows or dropped_events:
            logger.info("resumed at step %d: dropped %d metric row(s) and %d event(s) of later steps from %s",
                        step, dropped_rows, dropped_events, self.ctx.run_dir)


def _rewrite(path: Path, keep: Callable[[dict[str, Any]], bool]) -> int:
    """Rewrite `path` with the rows `keep` accepts (atomically: temp file + rename); returns how many were dropped.
    A torn last line (the killed writer's) goes too."""
    rows = read_jsonl(path)
    kept = [row for row in rows if keep(row)]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(row, allow_nan=False) + "\n" for row in kept), encoding="utf-8")
    os.replace(tmp, path)
    return len(rows) - len(kept)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All complete JSON objects in `path`; a torn last line (run still writing) is skipped silently,
    a corrupt line in the middle is skipped with a warning. A missing file reads as empty."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").split("\n")
    rows: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            if i < len(lines) - 1 and any(s.strip() for s in lines[i + 1:]):
                logger.warning("%s:%d is not valid JSON; skipped", path, i + 1)
            continue
        if isinstance(obj, dict):
            rows.append(obj)
    return rows


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Rows of metrics.jsonl merged per step (later values win: resumed or rolled-back steps), sorted by step."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in read_jsonl(Path(run_dir) / METRICS_FILE):
        if "step" not in row:
            continue
        step = int(row["step"])
        merged = by_step.setdefault(step, {})
        merged.update(row)
    return [by_step[s] for s in sorted(by_step)]


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    return read_jsonl(Path(run_dir) / EVENTS_FILE)
