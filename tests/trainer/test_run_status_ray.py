"""A Ray worker killed mid-run: the error the user sees names the call that failed and the dead
rank (not the `close_checkpoints` cleanup that fails after it), and `run_end` records `failed` with both."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from ppo_testlib import tiny_ppo_config

ray = pytest.importorskip("ray")

from hybridflow.controller import WorkerError  # noqa: E402
from hybridflow.tracking.jsonl import read_events  # noqa: E402
from hybridflow.trainer.ppo import PPOTrainer  # noqa: E402
from hybridflow.trainer.run import run_ppo  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

# Ray pickles functions of importable modules by reference; this test module is not importable in the actors.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _pid(host: Any) -> int:
    return os.getpid()


def kill_rank(trainer: PPOTrainer, rank: int) -> int:
    """SIGKILL the process of `rank` in the actor group; returns its pid once it is gone."""
    handle = trainer.groups.owners[0]._handles[rank]  # noqa: SLF001 - the test reaches into the Ray backend
    pid = ray.get(handle.__ray_call__.remote(_pid), timeout=60)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} (pid {pid}) still alive 30 s after SIGKILL")


def test_killed_worker_names_failing_call_and_run_end_is_failed(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tiny_ppo_config(tmp_path, tmp_path / "ckpt", 2, "trainer.backend=ray", "trainer.n_gpus_per_node=2",
                          "trainer.logger=[]", f"trainer.run_dir={tmp_path}/run", "trainer.total_training_steps=3",
                          "trainer.checkpoint.save_freq=1")
    step = PPOTrainer.step

    def step_after_kill(self: PPOTrainer, batch: Any) -> dict[str, float]:
        if self.global_step == 2:
            kill_rank(self, 1)
        return step(self, batch)

    monkeypatch.setattr(PPOTrainer, "step", step_after_kill)
    try:
        with pytest.raises(WorkerError) as info:
            run_ppo(cfg)
    finally:
        ray.shutdown()
    err = info.value
    assert err.rank == 1 and err.method.endswith("generate_sequences"), str(err)  # the call that failed first
    notes = "\n".join(getattr(err, "__notes__", []))
    assert "close" in notes, notes  # the cleanup's own failure is attached, not raised
    end = [e for e in read_events(tmp_path / "run") if e["kind"] == "run_end"]
    assert len(end) == 1 and end[0]["status"] == "failed", end
    assert end[0]["rank"] == 1 and end[0]["method"] == err.method and end[0]["error_type"] == "WorkerError"
    assert end[0]["step"] == 1  # step 1 was logged; step 2 died in generation


def test_sigterm_to_a_ray_driver_saves_and_exits_143(tmp_path: Path) -> None:
    """A scheduler's SIGTERM to the driver of a Ray run: the step finishes, a checkpoint is saved, `run_end` says
    `interrupted`, the process exits 143 with one line (was: `SystemExit: 15` from Ray's handler, exit 134)."""
    import json
    import subprocess

    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.5\n")
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    args = ["trainer.device=cpu", "trainer.backend=ray", "trainer.n_gpus_per_node=2", "trainer.cpu_threads=1",
            "model.override_config={num_hidden_layers: 1}", "data.train_size=16", "data.val_size=2",
            "data.max_response_length=6", "data.train_batch_size=2", "rollout.n=4", "actor.ppo_mini_batch_size=2",
            "reward.sources=[{name: custom, weight: 1.0}]", f"reward.custom.path={reward}",
            "trainer.val_before_train=false", "trainer.total_training_steps=200", "trainer.logger=[jsonl]",
            f"trainer.run_dir={run_dir}", f"trainer.default_local_dir={ckpt}", "trainer.checkpoint.save_freq=-1"]
    proc = subprocess.Popen([sys.executable, "-m", "hybridflow.cli", "train", "--quiet-config", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and metrics.read_text().strip():
            break
        time.sleep(0.5)
    assert proc.poll() is None, f"the run ended before its first step: {proc.communicate()[1][-3000:]}"
    os.kill(proc.pid, signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err[-3000:]
    assert "interrupted by SIGTERM at step" in err and "rerun the same command to resume" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    ends = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    ends = [e for e in ends if e["kind"] == "run_end"]
    assert ends and ends[-1]["status"] == "interrupted", ends
    assert any(p.name.startswith("global_step_") for p in ckpt.iterdir()), list(ckpt.iterdir())
