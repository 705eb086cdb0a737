"""Human-facing console output: one short line per logged step, a progress bar on a terminal, all metrics on request.

Every `trainer.log_every` steps the console prints one line — step/total, the training signal (reward or loss), the
validation metric when this step measured one, step time and ETA — short enough for any terminal or CI log, with
no control characters off a terminal. `verbose=True` (the commands' `--verbose`) prints the table of every metric
(grouped by namespace) instead. On a TTY a rich progress bar stays below the lines. The console renders for humans,
so it writes to its stream directly rather than through `logging`.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from hybridflow.tracking.base import TRACKERS, Backend, Event, RunContext

# The compact line: the training signal (first present), then the validation metrics a step measured (at most two).
TRAIN_SIGNAL: tuple[tuple[str, str], ...] = (
    ("reward/score/mean", "reward"), ("sft/loss", "loss"), ("rm/loss", "loss"), ("dpo/loss", "loss"),
)
VAL_SIGNAL: tuple[str, ...] = ("val/accuracy", "val/rewards/accuracies", "val/loss", "val/token_accuracy",
                               "val/reward")
PERCENT = ("val/accuracy", "val/rewards/accuracies", "val/token_accuracy")
_MAX_VAL_ITEMS = 2
_LEVEL_STYLE = {"info": "cyan", "warning": "bold yellow", "error": "bold red"}


def fmt_value(value: float) -> str:
    """Compact number: 4 significant digits, scientific notation for very large or very small magnitudes."""
    if value != value:  # NaN
        return "nan"
    a = abs(value)
    if a != 0 and (a >= 1e5 or a < 1e-3):
        return f"{value:.2e}"
    if float(value).is_integer() and a < 1e5:
        return str(int(value))
    return f"{value:.4g}"


def fmt_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def compact_line(metrics: dict[str, float], step: int, total: int | None = None, eta: float | None = None) -> str:
    """`step 3/30 · reward 0.412 · val/accuracy 45.3% · 1.20 s/step · eta 2m10s` (fields present only)."""
    parts = [f"step {step}" + (f"/{total}" if total else "") + (" (before training)" if step == 0 else "")]
    signal = [(label, metrics[key]) for key, label in TRAIN_SIGNAL if key in metrics]
    signal += [("loss", v) for k, v in metrics.items() if k.endswith("/loss") and not k.startswith("val/")]
    parts += [f"{label} {fmt_value(value)}" for label, value in signal[:1]]
    vals = [key for key in VAL_SIGNAL if key in metrics]
    if "val/accuracy" in vals and "val/reward" in vals:
        vals.remove("val/reward")  # the accuracy says more; the summary and the table show both
    for key in vals[:_MAX_VAL_ITEMS]:
        parts.append(f"{key} {100 * metrics[key]:.1f}%" if key in PERCENT else f"{key} {fmt_value(metrics[key])}")
    if "timing/step" in metrics:
        parts.append(f"{metrics['timing/step']:.2f} s/step")
    if eta is not None:
        parts.append(f"eta {fmt_duration(eta)}")
    return " · ".join(parts)


@TRACKERS.register("console")
class ConsoleBackend(Backend):
    """One compact line per logged step (all metrics as a table with `verbose`), plus a progress bar on a TTY."""

    name = "console"

    def __init__(self, ctx: RunContext, stream: IO[str] | None = None, tty: bool | None = None,
                 verbose: bool = False) -> None:
        super().__init__(ctx)
        self.stream = stream if stream is not None else sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None else tty
        self.verbose = verbose
        self.log_every = max(1, int(ctx.log_every))
        self.total: int | None = None
        self._start_step = 0
        self._start_time = time.monotonic()
        self._progress: Any = None
        self._task: Any = None
        self._rerouted: list[tuple[Any, Any]] = []
        self.console: Any = None
        if self.tty or verbose:  # off a terminal the table renders without control characters
            from rich.console import Console

            self.console = Console(file=self.stream, force_terminal=self.tty, highlight=False,
                                   width=None if self.tty else 120)

    # ----------------------------------------------------------------------------------------- progress
    def start_progress(self, total_steps: int, initial_step: int = 0) -> None:
        self.total = int(total_steps)
        self._start_step = int(initial_step)
        self._start_time = time.monotonic()
        if not self.tty:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(bar_width=24), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
            console=self.console, transient=False,
        )
        original = (sys.stdout, sys.stderr)
        self._progress.start()  # on a terminal rich swaps sys.stdout/stderr for proxies that print above the bar
        self._route_log_handlers(original)
        name = self.ctx.experiment if len(self.ctx.experiment) <= 24 else self.ctx.experiment[:23] + "…"
        self._task = self._progress.add_task(name, total=self.total, completed=initial_step, info="")

    def update_progress(self, step: int, metrics: dict[str, float] | None = None) -> None:
        if self._progress is None:
            return
        info = ""
        if metrics:
            parts = [f"{label} {fmt_value(metrics[key])}" for key, label in TRAIN_SIGNAL if key in metrics][:1]
            if "timing/step" in metrics:
                parts.append(f"{metrics['timing/step']:.2f} s/step")
            info = " · ".join(parts)
        self._progress.update(self._task, completed=step, info=info)

    def stop_progress(self) -> None:
        if self._progress is not None:
            for handler, stream in self._rerouted:
                handler.setStream(stream)
            self._rerouted = []
            self._progress.stop()
            self._progress = None

    def _route_log_handlers(self, original: tuple[Any, Any]) -> None:
        """Point root logging handlers that write to the real stdout/stderr at rich's proxies while the bar is
        shown, so log lines appear above the bar instead of tearing it (handlers keep the stream they were
        created with, which rich's redirect does not reach)."""
        import logging

        proxies = {id(original[0]): sys.stdout, id(original[1]): sys.stderr}
        for handler in logging.getLogger().handlers:
            stream = getattr(handler, "stream", None)
            if type(handler) is logging.StreamHandler and id(stream) in proxies and proxies[id(stream)] is not stream:
                self._rerouted.append((handler, handler.setStream(proxies[id(stream)])))

    def eta_seconds(self, step: int) -> float | None:
        done = step - self._start_step
        if self.total is None or done <= 0:
            return None
        return (time.monotonic() - self._start_time) / done * max(0, self.total - step)

    # ----------------------------------------------------------------------------------------- backend
    def log(self, metrics: dict[str, float], step: int) -> None:
        self.update_progress(step, metrics)
        due = step % self.log_every == 0 or (self.total is not None and step >= self.total)
        if not due:
            return
        if self.verbose:
            self.console.print(self._table(metrics, step))
        elif self.tty:
            self.console.print(self._line(metrics, step), markup=False)
        else:
            self._write(self._line(metrics, step))

    def event(self, event: Event) -> None:
        if self.tty:
            style = _LEVEL_STYLE.get(event.level, "white")
            self.console.print(f"[{style}]{event.level.upper()}[/] [bold]{event.kind}[/] (step {event.step}): "
                               f"{event.message}", markup=True)
        else:
            self._write(f"[step {event.step}] {event.level.upper()} {event.kind}: {event.message}")

    def close(self) -> None:
        self.stop_progress()
        self.stream.flush()

    # ----------------------------------------------------------------------------------------- rendering
    def _line(self, metrics: dict[str, float], step: int) -> str:
        return compact_line(metrics, step, self.total, self.eta_seconds(step))

    def _table(self, metrics: dict[str, float], step: int) -> Any:
        """All metrics as aligned `name value` pairs in as many column pairs as the terminal fits
        (column-major, sorted, so one namespace stays together); zero health counters are left out."""
        from rich import box
        from rich.table import Table

        title = f"step {step}" + (f"/{self.total}" if self.total else "")
        eta = self.eta_seconds(step)
        if eta is not None:
            title += f"  ·  eta {fmt_duration(eta)}"
        items = [(k, fmt_value(v)) for k, v in sorted(metrics.items())
                 if not (k.startswith("health/") and v == 0) and not k.startswith("training/")]
        key_w = max((len(k) for k, _ in items), default=8)
        val_w = max((len(v) for _, v in items), default=6)
        ncols = max(1, min(4, (self.console.width + 2) // (key_w + val_w + 5)))
        nrows = -(-len(items) // ncols) if items else 0
        table = Table(title=title, box=box.SIMPLE_HEAD, show_header=False, title_justify="left", pad_edge=False,
                      title_style="bold")
        for _ in range(ncols):
            table.add_column(style="cyan", no_wrap=True)
            table.add_column(justify="right", style="bold", no_wrap=True)
        for r in range(nrows):
            cells: list[str] = []
            for c in range(ncols):
                i = c * nrows + r
                cells += list(items[i]) if i < len(items) else ["", ""]
            table.add_row(*cells)
        return table

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()
