"""metrics.jsonl / events.jsonl: one flushed object per call, strict JSON, tolerant readers."""

from __future__ import annotations

import json
import math
from pathlib import Path

from hybridflow.tracking.base import Event, RunContext
from hybridflow.tracking.jsonl import JsonlBackend, read_events, read_jsonl, read_metrics


def test_one_flushed_object_per_step(tmp_path: Path) -> None:
    b = JsonlBackend(RunContext(run_dir=tmp_path / "run"))
    for step in range(1, 4):
        b.log({"actor/pg_loss": 0.5 * step, "timing/gen": 1.0}, step)
        # readable before close: every line is flushed as it is written
        lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == step
        assert json.loads(lines[-1])["actor/pg_loss"] == 0.5 * step
    b.event(Event("gen_time", "slow", 3, level="warning", data={"value": 1.5}))
    b.close()
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("time" in r for r in rows)
    (ev,) = read_events(tmp_path / "run")
    assert ev["kind"] == "gen_time" and ev["level"] == "warning" and ev["value"] == 1.5 and ev["step"] == 3


def test_non_finite_values_become_null(tmp_path: Path) -> None:
    b = JsonlBackend(RunContext(run_dir=tmp_path))
    b.log({"a": math.nan, "b": math.inf, "c": 1.0}, 1)
    b.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in line and "Infinity" not in line
    json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(AssertionError(c)))  # strict JSON
    (row,) = read_metrics(tmp_path)
    assert row["a"] is None and row["b"] is None and row["c"] == 1.0


def test_reader_skips_torn_last_line_and_merges_steps(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n{"step": 2, "val/reward": 0.5}\n'
                    '{"step": 1, "x": 10}\n{"step": 3, "x"')  # resumed step 1 rewritten; writer mid-line
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["x"] == 10  # later row wins
    assert rows[1] == {"step": 2, "x": 2, "val/reward": 0.5}


def test_reader_skips_corrupt_middle_line(tmp_path: Path, caplog) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]
    assert "not valid JSON" in caplog.text
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_append_on_resume(tmp_path: Path) -> None:
    for start in (1, 3):
        b = JsonlBackend(RunContext(run_dir=tmp_path))
        b.log({"x": float(start)}, start)
        b.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 3]
