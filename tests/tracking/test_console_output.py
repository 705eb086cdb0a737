"""Console backend: line-based output without a TTY, a rich table and progress bar with one."""

from __future__ import annotations

import io
import re
from pathlib import Path

from hybridflow.tracking.base import Event, RunContext
from hybridflow.tracking.console import ConsoleBackend, fmt_duration, fmt_value

ANSI = re.compile(r"\x1b\[")


def metrics(step: int) -> dict[str, float]:
    return {"reward/score/mean": 0.1 * step, "actor/pg_loss": -0.01, "timing/step": 1.25, "timing/gen": 0.5,
            "health/gen_time": 0.0}


def test_non_tty_prints_one_plain_line_per_step(tmp_path: Path) -> None:
    buf = io.StringIO()
    con = ConsoleBackend(RunContext(run_dir=tmp_path), stream=buf)  # StringIO is not a TTY
    assert not con.tty
    con.start_progress(5)
    for step in range(1, 6):
        con.log(metrics(step), step)
    con.event(Event("gen_time", "timing/gen is slow", 3, level="warning"))
    con.close()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 6
    assert not ANSI.search(buf.getvalue())
    for step, line in enumerate(lines[:5], start=1):
        assert line.startswith(f"step {step}/5 · reward {fmt_value(0.1 * step)} · 1.25 s/step · eta ")
    assert lines[5] == "[step 3] WARNING gen_time: timing/gen is slow"


def test_compact_line_is_short_and_names_what_matters(tmp_path: Path) -> None:
    """By default a step is one short line — step/total, reward, the validation accuracy when measured, step time,
    ETA — not every metric (a PPO step logs ~60)."""
    buf = io.StringIO()
    con = ConsoleBackend(RunContext(run_dir=tmp_path), stream=buf, tty=False)
    many = {**metrics(10), **{f"actor/metric_{i}": 0.123456 * i for i in range(60)}, "val/reward": 0.61,
            "val/accuracy": 0.453, "val/hybridflow/arithmetic/accuracy": 0.453}
    con.start_progress(30)
    con.log(many, 10)
    line = buf.getvalue().rstrip("\n")
    assert "\n" not in line and len(line) <= 100, line
    assert line.startswith("step 10/30 · reward 1 · val/accuracy 45.3% · 1.25 s/step · eta "), line
    assert "actor/metric" not in line and "pg_loss" not in line


def test_supervised_lines_show_loss_and_validation(tmp_path: Path) -> None:
    """SFT's (and RM's, DPO's) line: its training loss, and its validation metrics on the steps that measured them."""
    buf = io.StringIO()
    con = ConsoleBackend(RunContext(run_dir=tmp_path), stream=buf, tty=False)
    con.log({"val/loss": 4.627, "val/token_accuracy": 0.0078}, 0)
    con.start_progress(400)
    sft = {"sft/loss": 4.6, "sft/lr": 1e-4, "sft/grad_norm": 3.0, "sft/num_tokens": 176.0, "timing/step": 0.2,
           "train/skipped_steps": 0.0, "sft/tokens_per_s_per_gpu": 22540.0}
    con.log(sft, 1)
    con.log({**sft, "val/loss": 4.5}, 2)
    lines = buf.getvalue().splitlines()
    assert lines[0] == "step 0 (before training) · val/loss 4.627 · val/token_accuracy 0.8%"
    assert lines[1].startswith("step 1/400 · loss 4.6 · 0.20 s/step") and "val/" not in lines[1]
    assert lines[2].startswith("step 2/400 · loss 4.6 · val/loss 4.5 · 0.20 s/step")
    assert all(len(line) <= 100 for line in lines)


def test_non_tty_respects_log_every_and_prints_last_step(tmp_path: Path) -> None:
    buf = io.StringIO()
    con = ConsoleBackend(RunContext(run_dir=tmp_path, log_every=4), stream=buf, tty=False)
    con.start_progress(10)
    for step in range(1, 11):
        con.log(metrics(step), step)
    steps = [int(line.split()[1].split("/")[0]) for line in buf.getvalue().splitlines()]
    assert steps == [4, 8, 10]


def test_unknown_metrics_show_a_loss(tmp_path: Path) -> None:
    buf = io.StringIO()
    con = ConsoleBackend(RunContext(run_dir=tmp_path), stream=buf, tty=False)
    con.log({"train/loss": 2.5, "train/lr": 1e-5}, 7)
    assert buf.getvalue() == "step 7 · loss 2.5\n"


def test_verbose_prints_every_metric_as_a_table_without_a_terminal(tmp_path: Path) -> None:
    buf = io.StringIO()
    con = ConsoleBackend(RunContext(run_dir=tmp_path), stream=buf, tty=False, verbose=True)
    con.start_progress(3)
    con.log(metrics(1), 1)
    out = buf.getvalue()
    assert not ANSI.search(out)
    assert "step 1/3" in out and "actor/pg_loss" in out and "timing/gen" in out and "reward/score/mean" in out


def test_tty_renders_table_and_progress(tmp_path: Path) -> None:
    buf = io.StringIO()
    con = ConsoleBackend(RunContext(run_dir=tmp_path, experiment="exp1"), stream=buf, tty=True, verbose=True)
    con.start_progress(3)
    for step in range(1, 4):
        con.log(metrics(step), step)
    con.event(Event("val_drop", "val/reward fell", 3, level="warning"))
    con.close()
    out = ANSI.sub("", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue()))
    assert "step 3/3" in out and "reward" in out and "pg_loss" in out and "timing" in out
    assert "exp1" in out and "3/3" in out  # progress bar description and M/N column
    assert "WARNING val_drop (step 3): val/reward fell" in out


def test_tty_default_prints_compact_lines_above_the_bar(tmp_path: Path) -> None:
    buf = io.StringIO()
    con = ConsoleBackend(RunContext(run_dir=tmp_path, experiment="exp1"), stream=buf, tty=True)
    con.start_progress(3)
    for step in range(1, 4):
        con.log(metrics(step), step)
    con.close()
    out = ANSI.sub("", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue()))
    assert "step 3/3 · reward 0.3 · 1.25 s/step" in out and "pg_loss" not in out


def test_tty_log_lines_go_above_the_bar(tmp_path: Path, monkeypatch) -> None:
    import logging
    import sys

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    handler = logging.StreamHandler(err)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        buf = io.StringIO()
        con = ConsoleBackend(RunContext(run_dir=tmp_path), stream=buf, tty=True)
        con.start_progress(2)
        logging.getLogger("some.module").warning("checkpoint saved")
        con.stop_progress()
        logging.getLogger("some.module").warning("after the bar")
    finally:
        root.removeHandler(handler)
    assert "checkpoint saved" in buf.getvalue()  # rendered by the live console, above the bar
    assert handler.stream is err and "after the bar" in err.getvalue()  # restored afterwards


def test_formatting_helpers() -> None:
    assert fmt_value(0.123456) == "0.1235"
    assert fmt_value(3.0) == "3"
    assert fmt_value(12345678.0) == "1.23e+07"
    assert fmt_value(0.0001234) == "1.23e-04"
    assert fmt_value(float("nan")) == "nan"
    assert fmt_duration(59) == "59s" and fmt_duration(61) == "1m01s" and fmt_duration(3725) == "1h02m"
