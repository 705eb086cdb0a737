"""Controller without Ray: dispatch functions against naive references, the local backend, colocation, errors."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hybridflow.controller import (
    DISPATCH_MODES,
    Dispatch,
    DispatchContext,
    DispatchInfo,
    DispatchPlan,
    Execute,
    GroupFuture,
    ResourcePool,
    Worker,
    WorkerError,
    WorkerGroup,
    build_backend,
    create_colocated_worker_cls,
    create_role_groups,
    register,
    register_dispatch_mode,
    spawn,
)
from hybridflow.controller.backends import LocalBackend
from hybridflow.controller.decorator import DpLayout, registered_methods
from hybridflow.protocol import DataProto


def _batch(n: int) -> DataProto:
    data = DataProto.from_single_dict({"x": torch.arange(n, dtype=torch.float32)})
    data.non_tensor_batch["tag"] = np.array([f"row{i}" for i in range(n)], dtype=object)
    return data


def _ctx(infos: list[DispatchInfo], backend_kind: str = "local") -> DispatchContext:
    return DispatchContext(len(infos), backend_kind, lambda: infos, "test group")


# ------------------------------------------------------------------------------------ dispatch functions (pure)
def test_dp_dispatch_with_tensor_parallel_peers_matches_naive_split():
    # 4 ranks = 2 dp ranks × 2 tp peers; rank 1 and 3 are peers whose outputs are not gathered
    infos = [DispatchInfo(r // 2, 2, r % 2 == 0) for r in range(4)]
    ctx = _ctx(infos)
    mode = DISPATCH_MODES[Dispatch.DP_COMPUTE_PROTO.value]
    data = _batch(5)
    plan = mode.dispatch(ctx, (data,), {"scale": 3})
    # naive reference: pad 5 → 6 by repeating row 0, then rows [0:3] to dp 0, [3:6] to dp 1
    expected_rows = [[0, 1, 2], [0, 1, 2], [3, 4, 0], [3, 4, 0]]
    assert [a[0].batch["x"].tolist() for a in plan.args] == expected_rows
    assert [k["scale"] for k in plan.kwargs] == [3, 3, 3, 3]
    assert plan.rows == (1, 5)
    outputs = [a[0] for a in plan.args]
    outputs[1] = outputs[3] = None  # non-collected peers' outputs must be ignored
    merged = mode.collect(ctx, outputs, plan.state)
    assert merged.batch["x"].tolist() == [0, 1, 2, 3, 4]
    assert list(merged.non_tensor_batch["tag"]) == [f"row{i}" for i in range(5)]


def test_dp_metric_collects_one_output_per_dp_rank():
    infos = [DispatchInfo(1 - r // 2, 2, r % 2 == 1) for r in range(4)]  # dp ranks reversed, odd ranks collect
    ctx = _ctx(infos)
    mode = DISPATCH_MODES[Dispatch.DP_COMPUTE_METRIC.value]
    plan = mode.dispatch(ctx, (_batch(4),), {})
    assert [a[0].batch["x"].tolist() for a in plan.args] == [[2, 3], [2, 3], [0, 1], [0, 1]]
    assert mode.collect(ctx, ["r0", "r1", "r2", "r3"], plan.state) == ["r3", "r1"]  # dp 0 then dp 1


def test_dp_collect_rejects_non_row_aligned_and_non_proto_outputs():
    ctx = _ctx([DispatchInfo(r, 2, True) for r in range(2)])
    mode = DISPATCH_MODES[Dispatch.DP_COMPUTE_PROTO.value]
    plan = mode.dispatch(ctx, (_batch(3),), {})
    with pytest.raises(ValueError, match="row-aligned"):
        mode.collect(ctx, [_batch(1), _batch(1)], plan.state)
    with pytest.raises(TypeError, match="DP_COMPUTE_METRIC"):
        mode.collect(ctx, [{"loss": 1.0}, {"loss": 2.0}], plan.state)
    assert mode.collect(ctx, [None, None], plan.state) is None


def test_dp_dispatch_checks_lengths_and_broadcasts_non_proto_args():
    ctx = _ctx([DispatchInfo(r, 2, True) for r in range(2)])
    mode = DISPATCH_MODES[Dispatch.DP_COMPUTE_PROTO.value]
    with pytest.raises(ValueError, match="same length"):
        mode.dispatch(ctx, (_batch(4), _batch(6)), {})
    plan = mode.dispatch(ctx, (_batch(4), [1, 2]), {"other": _batch(4)})
    assert [a[1] for a in plan.args] == [[1, 2], [1, 2]]
    assert [k["other"].batch["x"].tolist() for k in plan.kwargs] == [[0, 1], [2, 3]]


def test_dp_layout_validation():
    with pytest.raises(ValueError, match="exactly once"):
        DpLayout.from_infos([DispatchInfo(0, 2, True), DispatchInfo(0, 2, True)], "g")
    with pytest.raises(ValueError, match="different dp_size"):
        DpLayout.from_infos([DispatchInfo(0, 2, True), DispatchInfo(0, 1, True)], "g")
    with pytest.raises(ValueError, match="dp_rank"):
        Worker().set_dispatch_info(2, 2)


def test_all_to_all_splits_lists_per_rank():
    ctx = _ctx([DispatchInfo(r, 3, True) for r in range(3)])
    mode = DISPATCH_MODES[Dispatch.ALL_TO_ALL.value]
    plan = mode.dispatch(ctx, ([1, 2, 3],), {"k": ["a", "b", "c"]})
    assert plan.args == [(1,), (2,), (3,)] and plan.kwargs == [{"k": "a"}, {"k": "b"}, {"k": "c"}]
    with pytest.raises(ValueError, match="keyword arg 'k'"):
        mode.dispatch(ctx, (), {"k": "abc"})


# ----------------------------------------------------------------------------------------------- local group
class Counter(Worker):
    def __init__(self, start: int = 0) -> None:
        super().__init__()
        self.count = start

    @register(Dispatch.ONE_TO_ALL)
    def incr(self, by: int = 1) -> int:
        self.count += by
        return self.count

    @register(Dispatch.ALL_TO_ALL)
    def set_to(self, value: int) -> int:
        self.count = value
        return value

    @register(Dispatch.RANK_ZERO)
    def peek(self) -> int:
        return self.count

    @register(Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def peek_plus(self, extra: int) -> int:
        return self.count + extra

    @register
    def double(self, data: DataProto) -> DataProto:
        return DataProto.from_single_dict({"x": data.batch["x"] * 2})

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def double_later(self, data: DataProto) -> DataProto:
        return self.double(data)

    @register(Dispatch.DP_COMPUTE_METRIC)
    def stats(self, data: DataProto) -> dict:
        return {"rows": len(data)}

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def explode(self) -> None:
        raise RuntimeError("kaboom")

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


def test_local_group_dispatch_modes():
    wg = WorkerGroup(None, Counter, backend="local", start=5)
    assert wg.world_size == 1 and wg.backend_kind == "local"
    assert wg.incr(by=2) == [7]
    assert wg.set_to([3]) == [3]
    assert wg.peek() == 3 and wg.peek_plus(10) == 13
    torch.testing.assert_close(wg.double(_batch(3)).batch["x"], torch.tensor([0.0, 2.0, 4.0]))
    assert wg.stats(_batch(3)) == [{"rows": 3}]
    assert wg.pid() == [os.getpid()]
    assert set(wg.method_names) >= {"incr", "set_to", "peek", "double", "stats"}


def test_local_futures_chain_between_groups():
    first = WorkerGroup(ResourcePool([1]), Counter, backend="local", name="first")
    second = WorkerGroup(ResourcePool([1]), Counter, backend="local", name="second")
    fut = first.double_later(_batch(4))
    assert isinstance(fut, GroupFuture) and fut.done()
    out = second.double(fut)
    torch.testing.assert_close(out.batch["x"], torch.arange(4.0) * 4)
    # a ONE_TO_ALL method gets the resolved value of a future too
    torch.testing.assert_close(WorkerGroup.wait(fut).batch["x"], torch.arange(4.0) * 2)


def test_local_errors_name_group_method_rank():
    wg = WorkerGroup(None, Counter, backend="local", name="counter")
    fut = wg.explode()  # non-blocking: the error surfaces at get(), as with Ray
    with pytest.raises(WorkerError) as info:
        fut.get()
    assert (info.value.group, info.value.method, info.value.rank) == ("counter", "explode", 0)
    assert "kaboom" in str(info.value) and "raise RuntimeError" in info.value.remote_traceback


def test_worker_error_names_the_driver_stage_and_reaches_run_end():
    from hybridflow.tracking.tracker import error_fields
    from hybridflow.utils.progress import in_stage

    wg = WorkerGroup(None, Counter, backend="local", name="counter")
    with in_stage("update_actor"), pytest.raises(WorkerError) as info:
        wg.explode().get()
    err = pickle.loads(pickle.dumps(info.value))  # Ray ships errors pickled
    assert err.stage == "update_actor" and "rank 0 in stage 'update_actor'" in str(err), str(err)
    fields = error_fields(WorkerError("g", "m", 1, "died", node="10.0.0.2 (node id ab12cd34)", stage="gen"))
    assert (fields["rank"], fields["node"], fields["stage"]) == (1, "10.0.0.2 (node id ab12cd34)", "gen")
    assert "node" not in error_fields(WorkerError("g", "m", 0, "raised"))  # outside a stage, off Ray: left out


def test_local_constructor_error_and_world_size_limit():
    class Broken(Worker):
        def __init__(self) -> None:
            super().__init__()
            raise KeyError("missing setting")

    with pytest.raises(WorkerError, match="__init__.*missing setting"):
        WorkerGroup(None, Broken, backend="local", name="broken")
    with pytest.raises(ValueError, match="backend='ray'"):
        WorkerGroup(ResourcePool([2]), Counter, backend="local")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="asks for a GPU"):
            WorkerGroup(ResourcePool([1], use_gpu=True), Counter, backend="local")


def test_shutdown_blocks_calls():
    with WorkerGroup(None, Counter, backend="local") as wg:
        assert wg.incr() == [1]
    with pytest.raises(RuntimeError, match="shut down"):
        wg.incr()


def test_colocated_local_roles_share_process():
    class Critic(Worker):
        def __init__(self, scale: float) -> None:
            super().__init__()
            self.scale = scale

        @register(Dispatch.ONE_TO_ALL)
        def pid(self) -> int:
            return os.getpid()

        @register
        def values(self, data: DataProto) -> DataProto:
            return DataProto.from_single_dict({"v": data.batch["x"] * self.scale})

    cls = create_colocated_worker_cls({"actor": (Counter, (), {"start": 1}), "critic": (Critic, (0.5,))})
    wg = WorkerGroup(None, cls, backend="local", name="colo")
    roles = spawn(wg)
    assert roles["actor"].pid() == roles["critic"].pid() == [os.getpid()]
    assert roles["actor"].incr() == [2] and wg.actor__incr() == [3]
    torch.testing.assert_close(roles["critic"].values(_batch(2)).batch["v"], torch.tensor([0.0, 0.5]))
    assert roles["critic"].execute_all("pid") == [os.getpid()]
    assert roles["critic"].name == "colo/critic"
    with pytest.raises(KeyError, match="no role 'ref'"):
        wg.role_view("ref")
    with pytest.raises(ValueError, match="not colocated"):
        spawn(WorkerGroup(None, Counter, backend="local"))
    with pytest.raises(ValueError, match="identifier"):
        create_colocated_worker_cls({"a__b": Counter})


def test_user_dispatch_mode_and_register_errors():
    def twice(ctx, args, kwargs):
        return DispatchPlan([(args[0] * 2,)] * ctx.world_size, [{}] * ctx.world_size)

    register_dispatch_mode("test_twice", twice, lambda ctx, outs, state: outs[0] + 1, override=True)

    class Custom(Worker):
        @register("test_twice")
        def echo(self, x: int) -> int:
            return x

    assert WorkerGroup(None, Custom, backend="local").echo(4) == 9
    assert registered_methods(Custom)["echo"].dispatch_mode == "test_twice"

    class Unknown(Worker):
        @register("no_such_mode")
        def echo(self, x: int) -> int:
            return x

    with pytest.raises(ValueError, match="no_such_mode"):
        WorkerGroup(None, Unknown, backend="local")

    class Clash(Worker):
        @register(Dispatch.ONE_TO_ALL)
        def shutdown(self) -> None:
            pass

    with pytest.raises(ValueError, match="collides"):
        WorkerGroup(None, Clash, backend="local")
    with pytest.raises(TypeError, match="Worker subclass"):
        WorkerGroup(None, object, backend="local")


def test_init_distributed_world_size_one_is_cheap_and_idempotent():
    if dist.is_initialized():
        pytest.skip("another test left a default process group")
    worker = Worker()
    try:
        worker.init_distributed()
        worker.init_distributed()
        t = torch.tensor([3.0], device=worker.device)
        dist.all_reduce(t)
        assert t.item() == 3.0 and dist.get_world_size() == 1
        assert dist.get_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
    finally:
        dist.destroy_process_group()


def test_build_backend_and_resource_pool():
    assert isinstance(build_backend("auto", 1), LocalBackend)
    try:
        import ray  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"hybridflow\[ray\]"):
            build_backend("auto", 2)
    else:
        assert build_backend("auto", 2).kind == "ray"
    with pytest.raises(ValueError, match="auto, local, ray"):
        build_backend("mpi", 1)
    with pytest.raises(ValueError, match="process_on_nodes"):
        ResourcePool([0])
    with pytest.raises(ValueError, match="max_colocate_count"):
        ResourcePool([1], max_colocate_count=0)
    assert ResourcePool([2, 3]).world_size == 5 and ResourcePool([2, 3]).nnodes == 2


def test_resource_pool_from_config():
    from hybridflow.config import load_config

    cfg = load_config(files=[], overrides=["trainer.nnodes=2", "trainer.n_gpus_per_node=4", "trainer.device=cpu",
                                           "resource_pool.max_colocate_count=2"])
    pool = ResourcePool.from_config(cfg)
    assert pool.process_on_nodes == [4, 4] and pool.max_colocate_count == 2 and pool.use_gpu is False


def test_ray_tensor_serializer_round_trip():
    from hybridflow.controller.backends.ray_tensors import _deserialize, _serialize

    base = torch.randn(6, 4)
    cases = [base, base[2:4], base.t(), base.to(torch.bfloat16), base > 0, torch.arange(5), torch.tensor(3.5),
             torch.empty(0, 3), base.clone().requires_grad_(True)]
    for t in cases:
        state = _serialize(t)
        out = _deserialize(state)
        assert out.dtype == t.dtype and out.shape == t.shape and torch.equal(out, t.detach())
        if out.is_floating_point():
            out.add_(1)  # the receiver owns a writable copy
    assert torch.equal(cases[0], base)
    # a row slice ships its own rows only, not the whole storage
    assert _serialize(base[2:4])[3].nbytes == 2 * 4 * 4
    assert _serialize(torch.randn(2, 2, dtype=torch.complex64))[0] == "pickle"


def test_create_role_groups_colocated_or_separate():
    roles = {"actor": (Counter, (), {"start": 10}), "ref": Counter}
    colocated = create_role_groups(roles, ResourcePool([1]), colocate=True, backend="local")
    assert colocated["actor"].incr() == [11] and colocated["ref"].incr() == [1]
    assert colocated["actor"].name == "actor+ref/actor"
    separate = create_role_groups(roles, {"actor": ResourcePool([1]), "ref": ResourcePool([1])}, colocate=False,
                                  backend="local")
    assert separate["actor"].name == "actor" and separate["actor"].incr() == [11] and separate["ref"].peek() == 0
    with pytest.raises(ValueError, match="no resource pool for role 'ref'"):
        create_role_groups(roles, {"actor": ResourcePool([1])}, colocate=False, backend="local")
    with pytest.raises(ValueError, match="one ResourcePool"):
        create_role_groups(roles, {"actor": ResourcePool([1])}, colocate=True, backend="local")
