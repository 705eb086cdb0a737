"""Hang watchdog with Ray (CPU): rank 1 sleeping inside a call stops the wait within seconds of the timeout, with a
stack file per rank (rank 1's names the sleeping function); ranks that keep beating are left alone."""

from __future__ import annotations

import sys
import time

import pytest

ray = pytest.importorskip("ray")

from hybridflow.controller import Dispatch, ResourcePool, Worker, WorkerGroup, register  # noqa: E402
from hybridflow.controller.backends.ray import init_ray  # noqa: E402
from hybridflow.controller.errors import HangError  # noqa: E402
from hybridflow.controller.hang import HangWatchdog  # noqa: E402
from hybridflow.utils.progress import beat  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def rank_one_sleeps_here(seconds: float) -> None:
    time.sleep(seconds)


class RankNapWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def update_actor(self, seconds: float) -> int:
        if self.rank == 1:
            rank_one_sleeps_here(seconds)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def slow_but_beating(self, steps: int, step_s: float) -> int:
        for i in range(steps):
            time.sleep(step_s)
            beat(i)
        return steps

    @register(Dispatch.ONE_TO_ALL)
    def hang_timeout(self) -> float:
        return self.worker_env.hang_timeout_s


@pytest.fixture(scope="module")
def pool():
    init_ray(num_cpus=4)
    pool = ResourcePool([2], max_colocate_count=2, use_gpu=False, name="hang_pool")
    yield pool
    pool.release()
    ray.shutdown()


def test_ray_sleeping_rank_stops_with_stacks(pool, tmp_path):
    with HangWatchdog(2.0, tmp_path / "hang", poll_s=0.2) as wd:
        wg = WorkerGroup(pool, RankNapWorker, backend="ray", name="actor")
        assert wg.hang_timeout() == [2.0, 2.0]
        start = time.monotonic()
        with pytest.raises(HangError) as info:
            wg.update_actor(120.0)
        took = time.monotonic() - start
        with pytest.raises(HangError):  # a cleanup's call on the hung group fails fast instead of waiting
            wg.hang_timeout()
        wg.shutdown()
    assert took < 8.0, took
    err = info.value
    assert (err.stage, err.rank, err.group, err.method) == ("update_actor", 1, "actor", "update_actor")
    assert str(err).startswith("hang in update_actor on rank 1"), err
    assert wd.fired is err
    rank1 = (tmp_path / "hang" / "actor.rank1.txt").read_text()
    assert "rank_one_sleeps_here" in rank1 and "update_actor" in rank1, rank1
    assert "rank_one_sleeps_here" not in (tmp_path / "hang" / "actor.rank0.txt").read_text()
    assert "update_actor" in (tmp_path / "hang" / "driver.txt").read_text()


def test_ray_slow_but_progressing_ranks_are_not_stopped(pool, tmp_path):
    with HangWatchdog(1.0, tmp_path / "hang", poll_s=0.1) as wd:
        wg = WorkerGroup(pool, RankNapWorker, backend="ray", name="slow")
        assert wg.slow_but_beating(10, 0.3) == [10, 10]  # 3 s per rank, a beat every 0.3 s
        wg.shutdown()
    assert wd.fired is None and not (tmp_path / "hang").exists()
