"""A Ray worker killed mid-run (issue 20, item 3): the error the user sees names the call that failed and the dead
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
