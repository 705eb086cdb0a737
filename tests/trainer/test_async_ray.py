"""trainer.mode=one_step_off on Ray (issue 27): the rollout worker is its own process; when it dies mid-run the
trainer stops at once with an error that names the rollout group, the call and the rank — no hang."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from ppo_testlib import tiny_ppo_config

ray = pytest.importorskip("ray")

from hybridflow.controller import WorkerError  # noqa: E402
from hybridflow.trainer.async_driver import RolloutWorkerFailed  # noqa: E402
from hybridflow.trainer.ppo import PPOTrainer  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _pid(host: Any) -> int:
    return os.getpid()


def test_killed_rollout_worker_is_named_and_nothing_hangs(tmp_path: Path) -> None:
    cfg = tiny_ppo_config(tmp_path, tmp_path / "ckpt", 2, "trainer.backend=ray", "trainer.mode=one_step_off",
                          "trainer.logger=[]", f"trainer.run_dir={tmp_path}/run", "trainer.total_training_steps=4",
                          "trainer.resume_mode=disable")
    trainer = PPOTrainer(cfg)
    alg = trainer.algorithm
    rollout_handle = trainer.groups.rollout.worker_group._handles[0]  # noqa: SLF001 - reach into the Ray backend
    trainer_pid = ray.get(trainer.groups.owners[0]._handles[0].__ray_call__.remote(_pid), timeout=60)  # noqa: SLF001
    rollout_pid = ray.get(rollout_handle.__ray_call__.remote(_pid), timeout=60)
    assert rollout_pid not in (trainer_pid, os.getpid())  # a process of its own
    step = alg.step
    seen: list[int] = []
    killed: list[float] = []

    def step_then_kill(batch: Any, n: int) -> dict[str, float]:
        out = step(batch, n)
        seen.append(n)
        if n == 2:  # step 3's batch is being generated (or queued) on the rollout worker: kill it
            os.kill(rollout_pid, signal.SIGKILL)
            killed.append(time.monotonic())
        return out

    alg.step = step_then_kill
    try:
        with pytest.raises(WorkerError) as info:
            trainer.fit()
    finally:
        trainer.close()
        ray.shutdown()
    err = info.value
    assert isinstance(err, RolloutWorkerFailed), repr(err)
    assert err.group == "rollout" and err.rank == 0, str(err)
    assert err.method in ("generate_sequences", "receive_weights"), str(err)
    # step 3's batch may have finished before the kill (then step 3 trains and step 4's generation is the lost one)
    lost = int(re.search(r"for step (\d+)", str(err)).group(1))
    assert "trainer.mode=one_step_off" in str(err) and lost in (3, 4), str(err)
    assert seen == list(range(1, lost)), (seen, lost)  # no step trained on a batch the dead worker did not finish
    assert time.monotonic() - killed[0] < 60, "the failure took too long to surface"
