"""Typed role handles: every handle the trainers hold declares exactly its worker's `@register`-ed methods
(names, signatures, result shapes), and a handle that drifts from its worker is refused when the group is made."""

from __future__ import annotations

import inspect

import pytest
import torch

from hybridflow.controller import (
    Dispatch,
    Execute,
    GroupFuture,
    RoleGroup,
    Worker,
    WorkerGroup,
    check_role_group,
    create_colocated_worker_cls,
    future,
    gathered,
    per_rank,
    register,
    spawn,
)
from hybridflow.controller.decorator import registered_methods
from hybridflow.controller.proxy import expected_shape
from hybridflow.protocol import DataProto
from hybridflow.trainer.roles import ROLES
from hybridflow.workers.supervised import SupervisedGroup, SupervisedWorker

HANDLES = [(role.handle_cls, role.worker_cls) for role in ROLES.values()] + [(SupervisedGroup, SupervisedWorker)]


@pytest.mark.parametrize("handle_cls,worker_cls", HANDLES, ids=[h.__name__ for h, _ in HANDLES])
def test_every_role_handle_matches_its_worker(handle_cls: type[RoleGroup], worker_cls: type) -> None:
    registered, declared = registered_methods(worker_cls), handle_cls.remotes()
    assert sorted(declared) == sorted(registered)
    for name, remote in declared.items():
        worker_fn = getattr(worker_cls, name)
        assert inspect.signature(remote.fn) == inspect.signature(worker_fn), name
        assert remote.shape == expected_shape(registered[name]), name
        assert remote.__doc__ == worker_fn.__doc__  # hover on the handle shows the worker's docstring
    check_role_group(handle_cls, worker_cls)  # what group creation runs


# ------------------------------------------------------------------------------------------ a small worker
class EchoWorker(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def double(self, data: DataProto) -> DataProto:
        """Twice each row."""
        return DataProto.from_dict({"y": data.batch["x"] * 2})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def where(self, tag: str = "") -> str:
        return f"{tag}{self.rank}"

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def leader(self) -> int:
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def later(self, x: int) -> int:
        return x + 1


class EchoGroup(RoleGroup):
    worker_cls = EchoWorker
    double = gathered(EchoWorker.double)
    where = per_rank(EchoWorker.where)
    leader = gathered(EchoWorker.leader)
    later = future(EchoWorker.later)


def test_handle_calls_run_the_worker_methods() -> None:
    with WorkerGroup(None, EchoWorker) as wg:
        echo = EchoGroup(wg)
        data = DataProto.from_single_dict({"x": torch.arange(3.0)})
        assert echo.double(data).batch["y"].tolist() == [0.0, 2.0, 4.0]
        assert echo.where(tag="r") == ["r0"]
        assert echo.leader() == 0
        fut = echo.later(4)
        assert isinstance(fut, GroupFuture) and fut.get() == [5]
        assert echo.double.__doc__ == "Twice each row."
        assert echo.worker_group is wg


def test_handle_of_a_colocated_role_view() -> None:
    cls = create_colocated_worker_cls({"echo": EchoWorker})
    with WorkerGroup(None, cls) as wg:
        echo = EchoGroup(spawn(wg)["echo"])
        assert echo.where(tag="v") == ["v0"]


# ------------------------------------------------------------------------------------------- mismatches
def test_missing_method_is_named_with_the_line_to_add() -> None:
    class Partial(RoleGroup):
        worker_cls = EchoWorker
        double = gathered(EchoWorker.double)
        leader = gathered(EchoWorker.leader)
        later = future(EchoWorker.later)

    with pytest.raises(TypeError, match=r"EchoWorker\.where\(self, tag: str = ''\) -> str is @register-ed but not "
                                        r"declared: add `where = per_rank\(EchoWorker\.where\)`"):
        check_role_group(Partial, EchoWorker)


def test_changed_worker_signature_is_caught() -> None:
    class ChangedWorker(EchoWorker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def where(self, tag: str = "", sep: str = "/") -> str:
            return f"{tag}{sep}{self.rank}"

    with pytest.raises(TypeError, match=r"where: declared from EchoWorker\.where\(self, tag: str = ''\) -> str but "
                                        r"ChangedWorker\.where is \(self, tag: str = '', sep: str = '/'\) -> str"):
        check_role_group(EchoGroup, ChangedWorker)
    with WorkerGroup(None, ChangedWorker) as wg, pytest.raises(TypeError, match="ChangedWorker.where"):
        EchoGroup(wg)  # refused when the group is wrapped, before any call


def test_wrong_result_shape_extra_method_and_wrong_name_are_caught() -> None:
    class Wrong(RoleGroup):
        worker_cls = EchoWorker
        double = per_rank(EchoWorker.double)  # DP_COMPUTE_PROTO gives one DataProto
        where = per_rank(EchoWorker.where)
        leader = gathered(EchoWorker.leader)
        later = gathered(EchoWorker.later)  # blocking=False gives a future
        twice = gathered(EchoWorker.double)  # not the worker method's name
        gone = per_rank(WorkerWithGone.gone)  # EchoWorker has no such method

    with pytest.raises(TypeError) as err:
        check_role_group(Wrong, EchoWorker)
    text = str(err.value)
    assert "double: registered with dispatch_mode='dp_compute_proto'" in text and "`double = gathered(...)`" in text
    assert "`later = future(...)`" in text
    assert "declares gone but EchoWorker has no @register-ed method 'gone'" in text
    assert "declares twice = gathered(EchoWorker.double): the attribute must have the worker method's name" in text


def test_handle_around_another_workers_group_is_refused() -> None:
    with WorkerGroup(None, WorkerWithGone) as wg, pytest.raises(TypeError, match="runs WorkerWithGone, not a "
                                                                                  "subclass of the handle's "
                                                                                  "worker_cls EchoWorker"):
        EchoGroup(wg)


class WorkerWithGone(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def gone(self) -> None:
        return None
