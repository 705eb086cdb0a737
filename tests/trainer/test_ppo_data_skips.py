"""PPOTrainer reports the rows its datasets left out at load: one `data_skipped` event in events.jsonl (counts,
reasons, example rows) and `data/skipped_rows` in metrics.jsonl (tiny CPU model, one step)."""

from __future__ import annotations

import json
from pathlib import Path

from ppo_testlib import tiny_ppo_config

from hybridflow.data import task_splits, write_rows
from hybridflow.tracking import build_tracker
from hybridflow.trainer.ppo import PPOTrainer


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_skipped_rows_go_to_events_and_metrics(tmp_path: Path) -> None:
    rows, _ = task_splits("arithmetic", 8, 2, 1)
    empty = {**rows[0], "prompt": [{"role": "user", "content": ""}]}
    malformed = {**rows[1], "prompt": None}
    write_rows([rows[0], empty, *rows[1:4], malformed, *rows[4:]], tmp_path / "train.parquet")
    cfg = tiny_ppo_config(tmp_path, tmp_path / "ckpt", 2, f"data.train_files=[{tmp_path / 'train.parquet'}]",
                          "trainer.total_training_steps=1", "trainer.checkpoint.save_freq=0")
    run_dir = tmp_path / "run"
    tracker = build_tracker([], run_dir)
    trainer = PPOTrainer(cfg, tracker=tracker)
    try:
        trainer.fit()
    finally:
        trainer.close()
        tracker.close()
    events = [e for e in _jsonl(run_dir / "events.jsonl") if e["kind"] == "data_skipped"]
    assert len(events) == 1 and events[0]["level"] == "warning" and events[0]["skipped_rows"] == 2
    assert events[0]["train"] == {"rows_read": 10, "skipped": 2, "reasons": {"empty_prompt": 1, "malformed": 1},
                                  "example_rows": {"empty_prompt": [1], "malformed": [5]}}
    logged = [m["data/skipped_rows"] for m in _jsonl(run_dir / "metrics.jsonl") if "data/skipped_rows" in m]
    assert logged == [2.0]
