"""Tracker: backend selection from trainer.logger, jsonl always on, errors, health integration, run info."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hybridflow.config import load_config
from hybridflow.tracking import (
    TRACKERS,
    Backend,
    HealthMonitor,
    MissingTrackerPackage,
    Tracker,
    build_tracker,
)
from hybridflow.tracking.jsonl import read_events, read_metrics

HEALTH = SimpleNamespace(gen_time_warn_s=1.0, update_jitter_warn_s=0.1, jitter_window=3, val_drop_patience=2,
                         memory_warn_frac=0.95)
QUIET = {"console": {"stream": io.StringIO(), "tty": False}}


def test_jsonl_is_always_on(tmp_path: Path) -> None:
    tr = build_tracker([], tmp_path)
    assert [b.name for b in tr.backends] == ["jsonl"]
    tr.log({"x": 1.0}, 1)
    tr.close()
    assert read_metrics(tmp_path)[0]["x"] == 1.0


def test_unknown_logger_lists_registered_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        build_tracker(["console", "tensorbaord"], tmp_path)
    msg = str(err.value)
    assert "tensorbaord" in msg and "trainer.logger" in msg
    for name in TRACKERS.names():
        assert name in msg


def test_missing_package_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(MissingTrackerPackage) as err:
        build_tracker(["wandb"], tmp_path)
    assert "pip install 'hybridflow[tracking]'" in str(err.value) and "'wandb'" in str(err.value)


def test_failing_backend_is_disabled_not_fatal(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Broken(Backend):
        name = "broken"

        def log(self, metrics: dict[str, float], step: int) -> None:
            raise ConnectionError("tracking server down")

    tr = build_tracker([], tmp_path)
    tr.backends.append(Broken(tr.backends[0].ctx))
    tr.log({"x": 1.0}, 1)
    tr.log({"x": 2.0}, 2)
    tr.close()
    assert [r["x"] for r in read_metrics(tmp_path)] == [1.0, 2.0]
    assert caplog.text.count("disabling it") == 1


def test_health_events_flow_to_events_file_and_counters(tmp_path: Path) -> None:
    buf = io.StringIO()
    tr = build_tracker(["console"], tmp_path, health=HealthMonitor(HEALTH), console={"stream": buf, "tty": False})
    returned = []
    for step, (gen, val) in enumerate([(0.5, 0.6), (0.5, 0.5), (2.0, 0.4), (2.0, None)], start=1):
        m = {"timing/gen": gen} | ({"val/reward": val} if val is not None else {})
        returned += [e.kind for e in tr.log(m, step)]
    tr.close()
    assert returned == ["gen_time", "val_drop"]
    kinds = [e["kind"] for e in read_events(tmp_path)]
    assert kinds == ["gen_time", "val_drop", "run_end"]
    rows = read_metrics(tmp_path)
    assert rows[-1]["health/gen_time"] == 1.0 and rows[-1]["health/val_drop"] == 1.0
    assert rows[0]["health/gen_time"] == 0.0
    assert "WARNING gen_time" in buf.getvalue() and "WARNING val_drop" in buf.getvalue()


def test_metrics_are_cleaned(tmp_path: Path) -> None:
    import numpy as np
    import torch

    tr = build_tracker([], tmp_path)
    tr.log({"a": np.float32(0.5), "b": torch.tensor(2.0), "c": 3, "d": True, "bad": [1, 2]}, 1)
    tr.close()
    row = read_metrics(tmp_path)[0]
    assert row["a"] == 0.5 and row["b"] == 2.0 and row["c"] == 3.0 and row["d"] == 1.0 and "bad" not in row


def test_from_config_writes_run_info_and_context_manager_marks_failure(tmp_path: Path) -> None:
    cfg = load_config([], [f"trainer.run_dir={tmp_path}", "trainer.logger=[jsonl]", "trainer.experiment_name=e1"],
                      validate=False)
    with pytest.raises(RuntimeError), Tracker.from_config(cfg) as tr:
        assert tr.health is not None and tr.health.val_metric == cfg.trainer.rollback.metric
        tr.log({"x": 1.0}, 1)
        raise RuntimeError("boom")
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "versions.json").exists()
    versions = json.loads((tmp_path / "versions.json").read_text())
    assert versions["packages"]["torch"] and versions["python"]
    events = read_events(tmp_path)
    assert events[0]["kind"] == "run_start" and "torch" in events[0]["message"]
    assert events[-1]["kind"] == "run_end" and events[-1]["status"] == "failed"


def test_progress_context(tmp_path: Path) -> None:
    buf = io.StringIO()
    tr = build_tracker(["console"], tmp_path, console={"stream": buf, "tty": False})
    with tr.progress(total_steps=4, initial_step=2):
        tr.log({"reward/score/mean": 0.5}, 3)
        tr.advance(4)
    tr.close()
    assert buf.getvalue().splitlines()[0].startswith("step 3/4 · reward 0.5 · eta ")
