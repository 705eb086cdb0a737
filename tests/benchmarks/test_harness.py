"""The benchmark scripts' shared pieces (benchmarks/harness.py), without running a benchmark."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import harness


def test_write_json_replaces_the_file_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    harness.write_json(path, {"steps": [1]})
    harness.write_json(path, {"steps": [1, 2], "dir": tmp_path})  # a later save after each step; Path -> str
    assert json.loads(path.read_text()) == {"steps": [1, 2], "dir": str(tmp_path)}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_environment_takes_the_commit_from_bench_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    env = harness.environment(cuda_context=False)
    assert env["commit"] == "abc1234" and set(env) == {"date", "commit", "gpu", "torch", "python"}


def test_summaries_and_seed_lists() -> None:
    assert harness.summarize([{"a": 1.0, "b": 5.0}, {"a": 3.0}, {"a": 2.0}]) == {"a": 2.0, "b": 5.0}
    assert harness.min_med_max([0.1, 0.3, 0.2], scale=100) == "10.0 / 20.0 / 30.0"
    assert harness.min_med_max([]) == "–" and harness.cell(None) == "-" and harness.cell(0.5, "{:.0%}") == "50%"
    assert harness.parse_seeds("2-4") == [2, 3, 4] and harness.parse_seeds("0,7") == [0, 7]
    with pytest.raises(SystemExit, match="--numerics avx9: choose from default, avx2"):
        harness.parse_choices("default,avx9", harness.NUMERICS, "--numerics")


def test_run_child_merges_the_last_json_line_or_keeps_the_error(tmp_path: Path) -> None:
    jsonl = tmp_path / "runs.jsonl"
    ok = harness.run_child([sys.executable, "-c", "print('warm-up'); print('{\"gain\": 0.25}')"], {"seed": 1}, jsonl,
                           derive=lambda res: {"gain_pct": 100 * res["gain"]})
    assert ok["seed"] == 1 and ok["gain"] == 0.25 and ok["gain_pct"] == 25.0 and ok["returncode"] == 0
    bad = harness.run_child([sys.executable, "-c", "import sys; sys.exit('boom')"], {"seed": 2}, jsonl)
    assert bad["returncode"] == 1 and "boom" in bad["error"] and "gain" not in bad
    assert [json.loads(line)["seed"] for line in jsonl.read_text().splitlines()] == [1, 2]
