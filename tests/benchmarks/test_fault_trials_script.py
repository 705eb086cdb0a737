"""benchmarks/fault_trials.py on CPU: its own file so `--dist loadfile` runs it beside the other benchmark scripts'
tests, not after them."""

from __future__ import annotations

import importlib.util
import json

import pytest
from bench_testlib import run_module

pytestmark = pytest.mark.slow


def test_fault_trials_run_on_cpu(tmp_path):
    """Issue 20's fault script with 2 kill -9 trials during async saves, 1 SIGTERM + resume of an async run and
    (with Ray) 1 worker-kill trial."""
    ray_trials = "1" if importlib.util.find_spec("ray") is not None else "0"
    proc = run_module("benchmarks.fault_trials", "--ckpt-trials", "2", "--ray-trials", ray_trials, "--async-trials", "1",
                "--max-delay", "0.5", "--hang-trials", "0", "--out", str(tmp_path), timeout=600)
    assert "| kill -9 during async save | 2 | 2/2 |" in proc.stdout, proc.stdout
    assert "| SIGTERM + resume, trainer.mode=async | 1 | 1/1 |" in proc.stdout, proc.stdout
    result = json.loads((tmp_path / "fault_trials.json").read_text())
    assert result["checkpoint"]["usable"] == 2 and result["checkpoint"]["broken_checkpoints"] == 0
    if ray_trials == "1":
        trial = result["ray"]["rows"][0]
        assert trial["names_dead_rank"] and trial["names_training_call"] and trial["run_end"] == "failed", trial

def test_fault_trials_hang_trial_on_cpu(tmp_path):
    """The hang trial: rank 1 sleeps in update_actor; the run stops soon after trainer.hang_timeout_s=5 with a
    HangError naming the stage and rank, rank 1's stack dump names the sleeping function, run_end says failed."""
    pytest.importorskip("ray")
    proc = run_module("benchmarks.fault_trials", "--ckpt-trials", "0", "--ray-trials", "0", "--hang-trials", "1",
                "--hang-timeout", "5", "--out", str(tmp_path), timeout=600)
    assert "| Ray worker hangs in update_actor (hang_timeout_s=5) | 1 | – | – | 1/1 | 1/1 |" in proc.stdout, proc.stdout
    trial = json.loads((tmp_path / "fault_trials.json").read_text())["hang"]["rows"][0]
    assert trial["error_type"] == "HangError" and trial["names_stage_and_rank"] and trial["dump_names_sleeper"], trial
    assert "hang in update_actor on rank 1" in trial["run_end_message"], trial
    assert trial["seconds_past_timeout"] < 60, trial  # stopped, not waiting for the 600 s sleep
