"""`hybridflow quickstart` end to end as a user runs it (shortened): both phases print, the table and the gain line
come out, and the SFT phase says its stop rule."""

from __future__ import annotations

import os
import subprocess
import sys


def test_quickstart_command_runs_both_phases_and_prints_the_gain(tmp_path):
    overrides = [f"trainer.run_dir={tmp_path}/run", "sft.total_steps=4", "sft.extra_schedule_steps=2",
                 "trainer.total_training_steps=2", "trainer.test_freq=2", "data.val_size=8", "data.train_batch_size=8",
                 "actor.ppo_mini_batch_size=8", "rollout.n=4"]
    proc = subprocess.run([sys.executable, "-m", "hybridflow.cli", "quickstart", *overrides], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "1/2 SFT warm start (4 steps, then checks val loss ≤ 0.22" in out, out
    assert "sft_extra_schedule" in out and "sft_target_missed" in out  # 4 + 2 steps cannot reach it: the gate says so
    assert "2/2 GRPO" in out and "after SFT (before RL)" in out and "points, step 0 → " in out, out
    assert (tmp_path / "run" / "metrics.jsonl").exists() and (tmp_path / "run" / "sft" / "metrics.jsonl").exists()
