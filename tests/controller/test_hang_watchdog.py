"""Hang watchdog with the in-process backend: a sleeping call or driver stage stops within seconds of the timeout,
with stack dumps naming the sleeping function; a slow call that keeps beating is left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hybridflow.config import load_config
from hybridflow.controller import Dispatch, Worker, WorkerGroup, register
from hybridflow.controller.errors import HangError
from hybridflow.controller.hang import (
    COLLECTIVE_TIMEOUT_OFF_S,
    EXIT_CODE,
    HangWatchdog,
    active_watchdog,
    collective_timeout_s,
    collective_wait,
)
from hybridflow.tracking.jsonl import read_events
from hybridflow.trainer.run import tracked_run
from hybridflow.trainer.timing import StageTimer
from hybridflow.utils.progress import PROGRESS, beat, in_method

pytestmark = pytest.mark.timeout(120)


def sleeping_reward_fn(seconds: float) -> None:
    time.sleep(seconds)


class NapWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def nap_in_update(self, seconds: float) -> None:
        time.sleep(seconds)

    @register(Dispatch.ONE_TO_ALL)
    def slow_but_beating(self, steps: int, step_s: float) -> int:
        for i in range(steps):
            time.sleep(step_s)
            beat(i)
        return steps

    @register(Dispatch.ONE_TO_ALL)
    def collective_timeout(self) -> float:
        return self.worker_env.hang_timeout_s


def test_local_sleeping_call_stops_with_stacks(tmp_path):
    start = time.monotonic()
    with HangWatchdog(1.0, tmp_path / "hang", poll_s=0.1) as wd:
        wg = WorkerGroup(None, NapWorker, backend="local", name="nappers")
        assert wg.collective_timeout() == [1.0]  # the worker learns the run's hang timeout (collectives derive from it)
        with pytest.raises(HangError) as info:
            wg.nap_in_update(60.0)
        wg.shutdown()
    took = time.monotonic() - start
    assert took < 6.0, took
    err = info.value
    assert (err.stage, err.rank, err.group, err.method) == ("nap_in_update", 0, "nappers", "nap_in_update")
    assert str(err).startswith("hang in nap_in_update on rank 0"), err
    assert wd.fired is not None and active_watchdog() is None
    for name in ("driver.txt", "nappers.rank0.txt"):
        text = (tmp_path / "hang" / name).read_text()
        assert "nap_in_update" in text, text
    assert json.loads((tmp_path / "hang" / "progress.json").read_text())["nappers.rank0"]["method"] == "nap_in_update"


def test_local_slow_but_progressing_call_is_not_stopped(tmp_path):
    with HangWatchdog(0.6, tmp_path / "hang", poll_s=0.05) as wd:
        wg = WorkerGroup(None, NapWorker, backend="local", name="slow")
        assert wg.slow_but_beating(12, 0.2) == [12]  # 2.4 s, four times the timeout, a beat every 0.2 s
        wg.shutdown()
    assert wd.fired is None and not (tmp_path / "hang").exists()


def test_idle_driver_outside_stages_is_not_a_hang(tmp_path):
    with HangWatchdog(0.3, tmp_path / "hang", poll_s=0.05) as wd:
        time.sleep(1.0)
    assert wd.fired is None


def _cfg(tmp_path: Path, timeout_s: float | None):
    return load_config(overrides=["trainer.logger=[]", f"trainer.run_dir={tmp_path}/run",
                                  f"trainer.hang_timeout_s={'null' if timeout_s is None else timeout_s}"])


def test_tracked_run_records_a_driver_stage_hang(tmp_path):
    timer = StageTimer(sync_cuda=False)
    start = time.monotonic()
    with pytest.raises(HangError, match=r"^hang in reward on the driver"), tracked_run(_cfg(tmp_path, 1.0)):
        with timer("reward"):
            sleeping_reward_fn(60.0)
    assert time.monotonic() - start < 8.0
    end = [e for e in read_events(tmp_path / "run") if e["kind"] == "run_end"][-1]
    assert end["status"] == "failed" and end["error_type"] == "HangError", end
    assert "HangError: hang in reward on the driver" in end["message"], end
    assert "sleeping_reward_fn" in (tmp_path / "run" / "hang" / "driver.txt").read_text()


def test_tracked_run_without_timeout_starts_no_watchdog(tmp_path):
    seen = []
    with tracked_run(_cfg(tmp_path, 0)):
        seen.append(active_watchdog())
    with tracked_run(_cfg(tmp_path, None)):
        seen.append(active_watchdog())
    assert seen == [None, None]
    with tracked_run(_cfg(tmp_path, 1800)):
        seen.append(active_watchdog())
    assert isinstance(seen[-1], HangWatchdog) and seen[-1].timeout_s == 1800 and active_watchdog() is None


def test_collective_timeout_derives_from_hang_timeout():
    assert collective_timeout_s(0.0) == COLLECTIVE_TIMEOUT_OFF_S
    assert collective_timeout_s(1800.0) == 1980.0  # the watchdog (stack dumps, stage name) acts first
    assert collective_timeout_s(2.0) == 62.0


def test_watchdog_thread_is_gone_after_the_run(tmp_path):
    with HangWatchdog(5.0, tmp_path / "hang", poll_s=0.05):
        pass
    assert not [t for t in threading.enumerate() if t.name == "hybridflow-hang-watchdog"]


def test_hang_timeout_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="trainer.hang_timeout_s"):
        HangWatchdog(0.0, tmp_path)


class FakeBackend:
    """Progress records set by the test; a None record is a rank that did not answer (stuck holding the GIL)."""

    def __init__(self, snaps, stacks=None):
        self.snaps, self.stacks = snaps, stacks

    def progress(self, handles, timeout_s):
        return list(self.snaps)

    def dump_stacks(self, handles, timeout_s):
        return self.stacks or [f"stacks of rank {r}" for r in range(len(handles))]


WAITING_IN_ALL_REDUCE = """pid 11 rank 0
Thread 0x00007f3e493be6c0 (most recent call first):
  File "/venv/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/venv/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/src/hybridflow/engine/train_engine.py", line 258 in _global_norms
  File "/src/hybridflow/workers/actor_rollout_ref.py", line 107 in update_actor
  File "/src/hybridflow/controller/backends/host.py", line 63 in call

Current thread 0x00007f3e49bbf6c0 (most recent call first):
  File "/src/hybridflow/controller/backends/host.py", line 77 in dump_stacks
"""
SLEEPING = WAITING_IN_ALL_REDUCE.replace(
    '"/venv/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce', '"/x/t.py", line 3 in nap')


def _snap(method, beats, quiet_s, micro_batch=None):
    return {"stage": None, "method": method, "micro_batch": micro_batch, "beats": beats, "busy_s": quiet_s,
            "quiet_s": quiet_s}


def test_the_rank_quiet_longest_is_named_and_waiting_peers_listed(tmp_path):
    """Rank 0 waits in a collective for rank 1 (it beat more recently): rank 1 is the hang, rank 0 is listed."""
    backend = FakeBackend([_snap("update_actor", 5, 0.5, micro_batch=2), _snap("update_actor", 3, 0.9)])
    wd = HangWatchdog(10.0, tmp_path / "hang", poll_s=1.0)
    wd.watch("actor", backend, ["h0", "h1"])
    assert wd.poll(now=100.0) is None  # first sight: nothing has been still for 10 s yet
    backend.snaps = [_snap("update_actor", 5, 10.5, micro_batch=2), _snap("update_actor", 3, 10.9)]
    assert wd.poll(now=109.0) is None
    err = wd.poll(now=110.5)
    assert isinstance(err, HangError) and (err.rank, err.group, err.stage) == (1, "actor", "update_actor")
    assert "also without progress: actor rank 0 in update_actor" in str(err)
    assert (tmp_path / "hang" / "actor.rank1.txt").read_text() == "stacks of rank 1"


def test_a_rank_waiting_in_a_collective_is_not_blamed(tmp_path):
    """Rank 0 has been quiet longer, but its call sits in all_reduce (waiting for a peer); rank 1's does not."""
    backend = FakeBackend([_snap("update_actor", 5, 0.0), _snap("update_actor", 3, 0.0)],
                          stacks=[WAITING_IN_ALL_REDUCE, SLEEPING])
    wd = HangWatchdog(10.0, tmp_path / "hang", poll_s=1.0)
    wd.watch("actor", backend, ["h0", "h1"])
    assert wd.poll(now=0.0) is None
    backend.snaps = [_snap("update_actor", 5, 12.0), _snap("update_actor", 3, 11.0)]
    err = wd.poll(now=11.0)
    assert err is not None and err.rank == 1, err
    assert "actor rank 0 in update_actor (waiting in all_reduce)" in str(err)


def test_collective_wait_reads_the_calling_thread():
    assert collective_wait(WAITING_IN_ALL_REDUCE) == "all_reduce"
    assert collective_wait(SLEEPING) is None
    assert collective_wait("") is None


def test_a_rank_that_stops_answering_mid_call_is_a_hang(tmp_path):
    backend = FakeBackend([_snap("generate_sequences", 7, 0.1)])
    wd = HangWatchdog(5.0, tmp_path / "hang", poll_s=1.0)
    wd.watch("rollout", backend, ["h0"])
    assert wd.poll(now=0.0) is None
    backend.snaps = [None]  # stuck in C holding the GIL: its watch thread cannot answer
    assert wd.poll(now=4.0) is None
    err = wd.poll(now=5.5)
    assert err is not None and (err.rank, err.method) == (0, "generate_sequences")


def test_moving_beats_or_idle_ranks_never_fire(tmp_path):
    backend = FakeBackend([_snap("update_actor", 1, 0.0), _snap(None, 9, 50.0)])
    wd = HangWatchdog(5.0, tmp_path / "hang", poll_s=1.0)
    wd.watch("actor", backend, ["h0", "h1"])
    for t in range(0, 30, 3):  # rank 0 beats between polls; rank 1 is idle (no call) the whole time
        backend.snaps[0] = _snap("update_actor", 1 + t, 0.1)
        assert wd.poll(now=float(t)) is None
    assert wd.fired is None


def test_calls_on_two_threads_are_tracked_apart():
    """A Ray actor's concurrency group runs a call beside the default group's: when the first call ends before the
    second, the record must not keep showing it as running (an idle rank would look hung forever)."""
    first_in, first_may_end, second_in, second_may_end = (threading.Event() for _ in range(4))

    def call(name, entered, may_end):
        with in_method(name):
            entered.set()
            may_end.wait(10)

    a = threading.Thread(target=call, args=("generate", first_in, first_may_end))
    b = threading.Thread(target=call, args=("receive_weights", second_in, second_may_end))
    a.start()
    first_in.wait(10)
    b.start()
    second_in.wait(10)
    assert PROGRESS.snapshot()["method"] == "generate"  # the oldest call running
    first_may_end.set()
    a.join()
    assert PROGRESS.snapshot()["method"] == "receive_weights"
    second_may_end.set()
    b.join()
    assert PROGRESS.snapshot()["method"] is None


STUCK_IN_C = """
import signal, sys, time
from pathlib import Path
from hybridflow.controller.hang import HangWatchdog
from hybridflow.utils.progress import in_stage
out = Path(sys.argv[1])
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])  # the interrupt never lands: as if stuck in C
with HangWatchdog(0.5, out / "hang", poll_s=0.05, exit_grace_s=1.0,
                  on_unresponsive=lambda err: (out / "recorded.txt").write_text(str(err))):
    with in_stage("update_actor"):
        time.sleep(60)
"""


def test_a_main_thread_that_cannot_be_interrupted_is_ended(tmp_path):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", STUCK_IN_C, str(tmp_path)], capture_output=True, text=True,
                          timeout=60, env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert proc.returncode == EXIT_CODE, proc.stderr[-2000:]
    assert time.monotonic() - start < 40
    assert (tmp_path / "recorded.txt").read_text().startswith("hang in update_actor on the driver")
    assert "<string>" in (tmp_path / "hang" / "driver.txt").read_text()  # the stuck script's frame
