"""Crash safety: a child saving in a loop is SIGKILLed at random moments; the latest complete checkpoint loads.

Every complete checkpoint must hold exactly the tensors of its own step (never a mix or a truncation), `.tmp_*`
leftovers are ignored, and the next "run" resumes from the latest one and keeps saving.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from ranks_testlib import rank_context

from hybridflow.checkpoint import CheckpointManager, atomic


def _state(step: int) -> dict:
    return {"model": {"w": torch.full((256, 1024), float(step)), "b": torch.arange(4096) + step},
            "optimizer": {"state": {0: {"exp_avg": torch.full((64, 64), -float(step))}}, "param_groups": [{"lr": step}]}}


def _save_forever(root: str, start: int, atomic_save: bool, async_save: bool, started) -> None:
    torch.set_num_threads(1)
    # Widen the dangerous window (files written, marker/rename not yet) so that the random kills land in it often:
    # a small state on a fast disk saves in milliseconds, and a run of 6 kills could otherwise miss every save
    # (CI saw 0/6 once). Patched in this child only; the commit itself is the real one.
    commit_dir = atomic.commit_dir

    def slow_commit_dir(*args, **kwargs):
        time.sleep(0.03)
        return commit_dir(*args, **kwargs)

    atomic.commit_dir = slow_commit_dir
    mgr = CheckpointManager(root, atomic_save=atomic_save, async_save=async_save, keep_last_n=3)
    step = start
    started.set()
    while True:
        mgr.save(step, {"actor": _state(step)}, extra={"step": step})
        step += 1


def _check_all_complete(root: Path) -> int | None:
    """Load every complete checkpoint and verify it is exactly its step's state; return the latest step."""
    mgr = CheckpointManager(root, async_save=False)
    for step, path in atomic.list_complete(root):
        loaded = mgr.load(path, restore_rng=False)
        assert loaded.step == step == loaded.extra["step"]
        comp, ref = loaded.components["actor"], _state(step)
        assert torch.equal(comp["model"]["w"], ref["model"]["w"]), path
        assert torch.equal(comp["model"]["b"], ref["model"]["b"]), path
        assert torch.equal(comp["optimizer"]["state"][0]["exp_avg"], ref["optimizer"]["state"][0]["exp_avg"])
        assert comp["optimizer"]["param_groups"][0]["lr"] == step
    latest = atomic.find_latest(root)
    return None if latest is None else atomic.parse_step(latest.name)


@pytest.mark.parametrize("atomic_save,async_save,trials", [(True, True, 20), (True, False, 6), (False, False, 6)])
def test_sigkill_during_save_never_leaves_a_broken_latest(tmp_path: Path, atomic_save: bool, async_save: bool,
                                                          trials: int) -> None:
    # forkserver: children fork from a fresh server (torch and hybridflow preloaded), not from the big pytest
    # process, so each starts fast and never inherits an OpenMP pool.
    ctx = rank_context()
    rng = random.Random(1234)
    latest_step: int | None = None
    interrupted = done = 0
    # at least `trials` kills, more (up to 4x) while too few landed inside a save: on a busy machine the random
    # kill times can all fall between saves by chance, which says nothing about crash safety
    while done < trials or (interrupted < trials // 4 and done < 4 * trials):
        done += 1
        start = 1 if latest_step is None else latest_step + 1
        started = ctx.Event()
        proc = ctx.Process(target=_save_forever, args=(str(tmp_path), start, atomic_save, async_save, started))
        proc.start()
        assert started.wait(timeout=60), "child did not start"
        time.sleep(rng.uniform(0.0, 0.5))  # kill somewhere in the save loop: any phase of any save
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert proc.exitcode == -signal.SIGKILL
        names = [p.name for p in tmp_path.iterdir()]
        leftovers = [n for n in names if n.startswith((atomic.TMP_PREFIX, atomic.TRASH_PREFIX))]
        incomplete = [n for n in names if atomic.parse_step(n) is not None and not atomic.is_complete(tmp_path / n)]
        if atomic_save:
            assert not incomplete, f"a global_step_* directory without marker after a crash: {incomplete}"
        interrupted += bool(leftovers or incomplete)
        new_latest = _check_all_complete(tmp_path)
        if latest_step is not None:
            assert new_latest is not None and new_latest >= latest_step  # never lose the previous checkpoint
        latest_step = new_latest
    assert latest_step is not None and latest_step >= trials // 2, f"too little progress: latest {latest_step}"
    assert interrupted >= trials // 4, f"only {interrupted}/{done} kills landed during a save"
