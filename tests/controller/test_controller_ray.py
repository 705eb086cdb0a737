"""Ray backend on CPU (gloo): dispatch modes, padding, chained futures, colocation, failures, all-reduce, hangs.

One `ray.init(num_cpus=4)` for the module; most tests share one 2-worker group on a pool that allows several
groups per slot, so the file stays well under a minute of actor start-up.
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

ray = pytest.importorskip("ray")

from hybridflow.controller import (  # noqa: E402
    Dispatch,
    DispatchPlan,
    Execute,
    ResourcePool,
    Worker,
    WorkerError,
    WorkerGroup,
    WorkerTimeoutError,
    create_colocated_worker_cls,
    register,
    register_dispatch_mode,
    spawn,
)
from hybridflow.controller.backends.ray import init_ray  # noqa: E402
from hybridflow.controller.errors import HangError  # noqa: E402
from hybridflow.controller.hang import HangWatchdog  # noqa: E402
from hybridflow.protocol import DataProto  # noqa: E402
from hybridflow.utils.progress import beat  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

# Ray pickles classes of importable modules by reference; this test module is not importable in the actors.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _reverse_dispatch(ctx, args, kwargs):  # user mode: rank r gets the (world-1-r)-th entry of a list
    n = ctx.world_size
    return DispatchPlan([(args[0][n - 1 - r],) for r in range(n)], [{} for _ in range(n)])


def _sum_collect(ctx, outputs, state):
    return sum(outputs)


register_dispatch_mode("test_reverse_sum", _reverse_dispatch, _sum_collect, override=True)


class EchoWorker(Worker):
    def __init__(self, offset: float = 0.0) -> None:
        super().__init__()
        self.offset = offset

    @register(Dispatch.ONE_TO_ALL)
    def set_tp_pairs(self) -> None:
        """Both ranks become tensor-parallel peers of dp rank 0; only rank 0's output is gathered."""
        self.set_dispatch_info(dp_rank=0, dp_size=1, is_collect=self.rank == 0)

    @register(Dispatch.ONE_TO_ALL)
    def reset_dispatch(self) -> None:
        self.set_dispatch_info(dp_rank=self.rank, dp_size=self.world_size, is_collect=True)

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid(),
                "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT",
                                                        "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                        "NVSHMEM_DISABLE_NVLS")}}

    @register(Dispatch.ALL_TO_ALL)
    def scale(self, x: float, factor: float = 1.0) -> float:
        return x * factor + self.rank

    @register(Dispatch.RANK_ZERO)
    def only_zero(self, x: int) -> tuple[int, int]:
        return self.rank, x

    @register(Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def broadcast_on_zero(self, x: int) -> tuple[int, int]:
        return self.rank, x

    @register(Dispatch.DP_COMPUTE_PROTO)
    def add(self, data: DataProto, bias: float = 0.0) -> DataProto:
        out = DataProto.from_single_dict({"y": data.batch["x"] + self.offset + bias,
                                          "rank": torch.full((len(data),), self.rank)})
        out.non_tensor_batch["tag"] = data.non_tensor_batch["tag"].copy()
        return out

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def add_async(self, data: DataProto) -> DataProto:
        return self.add(data)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def rename(self, data: DataProto) -> DataProto:
        out = DataProto.from_single_dict({"x": data.batch["y"], "rank": torch.full((len(data),), self.rank)})
        out.non_tensor_batch["tag"] = data.non_tensor_batch["tag"].copy()
        return out

    @register(Dispatch.DP_COMPUTE_METRIC)
    def row_count(self, data: DataProto) -> dict:
        return {"rank": self.rank, "rows": len(data), "sum": float(data.batch["x"].sum())}

    @register("test_reverse_sum")
    def times_rank_plus_one(self, x: int) -> int:
        return x * (self.rank + 1)

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce(self, value: float) -> float:
        import torch.distributed as dist

        self.init_distributed()
        self.init_distributed()  # idempotent
        t = torch.tensor([value + self.rank])
        dist.all_reduce(t)
        return float(t.item())

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, bad_rank: int) -> int:
        if self.rank == bad_rank:
            raise ValueError(f"boom from rank {self.rank}")
        return self.rank

    @register(Dispatch.ONE_TO_ALL, timeout_s=0.5)
    def slow(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def die_on(self, bad_rank: int, others_sleep: float) -> int:
        if self.rank == bad_rank:
            time.sleep(0.3)
            os._exit(1)
        time.sleep(others_sleep)
        return self.rank


class CriticWorker(Worker):
    def __init__(self, value_scale: float) -> None:
        super().__init__()
        self.value_scale = value_scale

    @register(Dispatch.ONE_TO_ALL)
    def whoami(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid(), "role": "critic"}

    @register(Dispatch.DP_COMPUTE_PROTO)
    def values(self, data: DataProto) -> DataProto:
        x = data.batch["x"] if "x" in data.batch else data.batch["y"]
        return DataProto.from_single_dict({"v": x * self.value_scale})


def _batch(n: int) -> DataProto:
    data = DataProto.from_single_dict({"x": torch.arange(n, dtype=torch.float32)})
    data.non_tensor_batch["tag"] = __import__("numpy").array([f"row{i}" for i in range(n)], dtype=object)
    return data


@pytest.fixture(scope="module")
def ray_cluster():
    init_ray(num_cpus=4)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def shared_pool(ray_cluster):
    pool = ResourcePool([2], max_colocate_count=4, use_gpu=False, name="shared")
    yield pool
    pool.release()


@pytest.fixture(scope="module")
def echo(shared_pool):
    wg = WorkerGroup(shared_pool, EchoWorker, backend="ray", name="echo", offset=10.0)
    yield wg
    wg.shutdown()


def test_one_to_all_ranks_and_env(echo):
    infos = echo.whoami()
    assert [i["rank"] for i in infos] == [0, 1]
    assert {i["world_size"] for i in infos} == {2}
    assert len({i["pid"] for i in infos}) == 2 and os.getpid() not in {i["pid"] for i in infos}
    for i in infos:
        env = i["env"]
        assert env["RANK"] == str(i["rank"]) and env["WORLD_SIZE"] == "2" and env["LOCAL_RANK"] == str(i["rank"])
        assert int(env["MASTER_PORT"]) > 0
        assert (env["NCCL_NVLS_ENABLE"], env["TORCH_SYMM_MEM_DISABLE_MULTICAST"], env["NVSHMEM_DISABLE_NVLS"]) == (
            "0", "1", "1")


def test_all_to_all_rank_zero_and_user_mode(echo):
    assert echo.scale([1.0, 2.0], factor=[10.0, 100.0]) == [10.0, 201.0]
    with pytest.raises(ValueError, match="one entry per rank"):
        echo.scale([1.0, 2.0, 3.0])
    assert echo.only_zero(7) == (0, 7)
    assert echo.broadcast_on_zero(5) == (0, 5)
    # user mode: rank 0 gets 5, rank 1 gets 3 → 5*1 + 3*2
    assert echo.times_rank_plus_one([3, 5]) == 11


@pytest.mark.parametrize("n", [6, 7, 1])
def test_dp_compute_proto_pads_and_unpads(echo, n):
    data = _batch(n)
    out = echo.add(data, bias=0.5)
    assert len(out) == n
    torch.testing.assert_close(out.batch["y"], data.batch["x"] + 10.5)
    assert list(out.non_tensor_batch["tag"]) == [f"row{i}" for i in range(n)]
    per_rank = -(-n // 2)  # rows per rank after padding
    assert out.batch["rank"].tolist() == [i // per_rank for i in range(n)]


def test_dp_compute_metric_returns_raw_list(echo):
    metrics = echo.row_count(_batch(8))
    assert [m["rank"] for m in metrics] == [0, 1]
    assert [m["rows"] for m in metrics] == [4, 4]
    assert [m["sum"] for m in metrics] == [0 + 1 + 2 + 3, 4 + 5 + 6 + 7]


def test_all_reduce_sums_across_ranks(echo):
    # ranks contribute 1.0 + rank → 1 + 2
    assert echo.all_reduce(1.0) == [3.0, 3.0]


def test_worker_exception_names_group_method_rank(echo):
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        echo.fail_on(1)
    assert time.monotonic() - start < 10
    err = info.value
    assert (err.group, err.method, err.rank) == ("echo", "fail_on", 1)
    message = str(err)
    assert "'echo'" in message and "'fail_on'" in message and "rank 1" in message
    assert "boom from rank 1" in message and "Traceback" in message and "raise ValueError" in message
    assert echo.fail_on(5) == [0, 1]  # the group is still usable


def test_call_timeout(echo):
    start = time.monotonic()
    with pytest.raises(WorkerTimeoutError) as info:
        echo.slow(1.5)
    assert time.monotonic() - start < 1.4
    assert info.value.pending_ranks == [0, 1] and info.value.method == "slow"
    time.sleep(1.5)  # let the slow call finish; later calls queue behind it
    assert echo.slow(0.0) == [0, 1]


@pytest.fixture(scope="module")
def colocated(shared_pool):
    cls = create_colocated_worker_cls({"actor": (EchoWorker, (), {"offset": 1.0}), "critic": (CriticWorker, (2.0,))})
    wg = WorkerGroup(shared_pool, cls, backend="ray", name="colo")
    yield wg
    wg.shutdown()


def test_colocated_roles_share_process(colocated, echo):
    roles = spawn(colocated)
    actor_pids = [i["pid"] for i in roles["actor"].whoami()]
    critic = roles["critic"].whoami()
    assert [c["pid"] for c in critic] == actor_pids and len(set(actor_pids)) == 2
    assert not set(actor_pids) & {i["pid"] for i in echo.whoami()}
    assert [c["role"] for c in critic] == ["critic", "critic"]
    data = _batch(5)
    torch.testing.assert_close(roles["critic"].values(data).batch["v"], data.batch["x"] * 2.0)
    torch.testing.assert_close(roles["actor"].add(data).batch["y"], data.batch["x"] + 1.0)
    # the colocated group itself exposes role-prefixed methods
    torch.testing.assert_close(colocated.critic__values(data).batch["v"], data.batch["x"] * 2.0)


def test_futures_chain_between_groups(echo, colocated):
    actor = spawn(colocated)["actor"]
    data = _batch(7)
    fut = echo.add_async(data)
    assert fut.layout is not None and fut.layout.dp_size == 2 and fut.layout.pad_size == 1
    # same dp size: each rank of the second group receives the producer's chunk by ObjectRef
    chained = actor.rename(fut)
    assert not fut.fetched  # the producer's chunks never came back to the driver
    torch.testing.assert_close(chained.batch["x"], data.batch["x"] + 10.0)
    assert chained.batch["rank"].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert list(chained.non_tensor_batch["tag"]) == [f"row{i}" for i in range(7)]
    # dp size 1 (two tensor-parallel peers): each rank cuts its own slice; only rank 0 is gathered
    actor.set_tp_pairs()
    actor.refresh_dispatch_info()
    try:
        fut2 = echo.add_async(data)
        sliced = actor.rename(fut2)
        assert not fut2.fetched
        torch.testing.assert_close(sliced.batch["x"], data.batch["x"] + 10.0)
        assert sliced.batch["rank"].tolist() == [0] * 7
        # and the futures still resolve on the driver
        torch.testing.assert_close(fut.get().batch["y"], data.batch["x"] + 10.0)
        assert echo.wait([fut, fut2])[1].batch["y"].shape == (7,)
    finally:
        actor.reset_dispatch()
        actor.refresh_dispatch_info()


def test_non_colocated_roles_get_own_processes(ray_cluster, echo):
    """use_colocated_worker=false: the critic role runs in its own processes on its own pool."""
    with ResourcePool([1], use_gpu=False, name="critic_pool") as critic_pool:
        with WorkerGroup(critic_pool, CriticWorker, 3.0, backend="ray", name="critic") as critic:
            c = critic.whoami()
            assert c[0]["rank"] == 0 and c[0]["pid"] not in {i["pid"] for i in echo.whoami()}
            # a future from the 2-rank actor group feeds the 1-rank critic on another pool (sliced worker-side)
            values = critic.values(echo.add_async(_batch(5)))
            torch.testing.assert_close(values.batch["v"], (_batch(5).batch["x"] + 10.0) * 3.0)
            # a pool with max_colocate_count=1 takes one group
            with pytest.raises(ValueError, match="max_colocate_count=1"):
                WorkerGroup(critic_pool, EchoWorker, backend="ray", name="extra")


def test_resource_over_request_fails_early(ray_cluster):
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"process_on_nodes\[0\]=8 .* no node left has 8 free CPU.* of 4 free"):
        WorkerGroup(ResourcePool([8], use_gpu=False, name="huge"), EchoWorker, backend="ray")
    with pytest.raises(ValueError, match="GPU"):
        WorkerGroup(ResourcePool([1], use_gpu=True, name="gpu"), EchoWorker, backend="ray")
    assert time.monotonic() - start < 5


def test_dead_rank_named_before_its_echo(monkeypatch):
    """A rank killed inside a collective: its peers' "connection reset" can reach the driver before Ray reports
    the death; the driver must still name the dead rank (and not rank 0, the first rank that failed)."""
    from ray.exceptions import ActorDiedError, RayTaskError

    from hybridflow.controller.backends import ray as ray_backend
    from hybridflow.controller.errors import RemoteCallError

    echo_err = RayTaskError("call", "tb", RemoteCallError(0, "RuntimeError: Connection reset by peer", "tb0"))
    waited = []
    monkeypatch.setattr(ray_backend.ray, "wait", lambda refs, num_returns, timeout: waited.append(timeout))
    backend = ray_backend.RayBackend()
    refs, ranks = [object(), object()], [0, 1]
    # the peer's echo arrived first; the death is known once the grace wait is over
    monkeypatch.setattr(ray_backend, "_failures", lambda r, k: [(0, echo_err), (1, ActorDiedError())])
    err = backend._worker_error(refs, ranks, "g", "update_actor", echo_err)
    assert err.rank == 1 and waited == [backend.death_grace_s]
    assert "ActorDiedError" in str(err) and "rank 0: RuntimeError: Connection reset by peer" in str(err)
    # the death was raised first: still rank 1 (rank 0's failure comes first in rank order)
    err = backend._worker_error(refs, ranks, "g", "update_actor", ActorDiedError())
    assert err.rank == 1 and len(waited) == 1
    # both processes gone by the time the driver looks (e.g. rank 0 aborted by its NCCL watchdog): the death Ray
    # raised first wins, matched by actor id
    d0, d1 = ActorDiedError(), ActorDiedError()
    d0.actor_id, d1.actor_id = "a0", "a1"
    monkeypatch.setattr(ray_backend, "_failures", lambda r, k: [(0, d0), (1, d1)])
    assert backend._worker_error(refs, ranks, "g", "update_actor", d1).rank == 1
    # no death: the worker's own exception and traceback, as before
    monkeypatch.setattr(ray_backend, "_failures", lambda r, k: [(0, echo_err)])
    err = backend._worker_error(refs, ranks, "g", "update_actor", echo_err)
    assert err.rank == 0 and err.remote_traceback == "tb0"


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


def test_hang_watchdog_stops_a_sleeping_rank_with_stacks(shared_pool, tmp_path):
    """Rank 1 sleeps inside a call: the wait ends with a HangError naming the stage and rank within seconds of
    the timeout; one stack file per rank, rank 1's names the sleeping function."""
    with HangWatchdog(2.0, tmp_path / "hang", poll_s=0.2) as wd:
        wg = WorkerGroup(shared_pool, RankNapWorker, backend="ray", name="actor")
        assert wg.hang_timeout() == [2.0, 2.0]  # the workers' collective timeouts derive from it
        start = time.monotonic()
        with pytest.raises(HangError) as info:
            wg.update_actor(120.0)
        took = time.monotonic() - start
        with pytest.raises(HangError):  # a cleanup's call on the hung group fails fast instead of queuing
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


def test_hang_watchdog_leaves_slow_but_progressing_ranks_alone(shared_pool, tmp_path):
    with HangWatchdog(1.0, tmp_path / "hang", poll_s=0.1) as wd:
        wg = WorkerGroup(shared_pool, RankNapWorker, backend="ray", name="slow")
        assert wg.slow_but_beating(10, 0.3) == [10, 10]  # 3 s per rank, a beat every 0.3 s
        wg.shutdown()
    assert wd.fired is None and not (tmp_path / "hang").exists()


def test_dead_worker_reported_quickly(colocated):
    """Last: kills a process of the colocated group."""
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        colocated.actor__die_on(1, 60.0)
    assert time.monotonic() - start < 30
    assert info.value.rank == 1 and info.value.method == "actor__die_on" and "colo" in str(info.value)
