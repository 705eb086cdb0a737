"""Typed driver-side handles of worker groups: a role's remote interface is declared once — by the worker's own
`@register` methods — and the handle refers to them, so "go to definition" from the trainer reaches the worker
method and the parameter types follow it.

    class CriticGroup(RoleGroup):
        worker_cls = CriticWorker
        compute_values = gathered(CriticWorker.compute_values)  # (data: DataProto) -> DataProto
        update_critic = per_rank(CriticWorker.update_critic)    # (data: DataProto) -> list[dict[str, float]]

The parameters come from the worker method (a `ParamSpec`); the result type from the helper, which must agree
with the method's dispatch mode: `gathered` = one result (DataProto chunks concatenated, rank 0's output),
`per_rank` = a list with one entry per rank (ONE_TO_ALL, DP_COMPUTE_METRIC), `future` = `blocking=False`.
`RoleGroup(wg)` checks the handle against the group's worker class — every registered method declared, nothing
else, same names and signatures, result shapes that match — and raises a `TypeError` naming what differs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Concatenate, Generic, Literal, ParamSpec, TypeVar, overload

from hybridflow.controller.decorator import DISPATCH_MODES, Execute, RegisterSpec, registered_methods
from hybridflow.controller.futures import GroupFuture

if TYPE_CHECKING:
    from hybridflow.controller.worker_group import WorkerGroup

P = ParamSpec("P")
R = TypeVar("R")
Shape = Literal["gathered", "per_rank", "future"]


class Remote(Generic[P, R]):
    """One declared remote method of a `RoleGroup`: `fn` is the worker method it runs on every rank."""

    def __init__(self, fn: Callable[..., Any], shape: Shape) -> None:
        self.fn, self.shape, self.name = fn, shape, fn.__name__
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __set_name__(self, owner: type, attr: str) -> None:
        self.attr = attr

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Remote[P, R]: ...

    @overload
    def __get__(self, obj: RoleGroup, owner: type | None = None) -> Callable[P, R]: ...

    def __get__(self, obj: RoleGroup | None, owner: type | None = None) -> Remote[P, R] | Callable[P, R]:
        if obj is None:
            return self
        return obj.worker_group.method(self.name)  # type: ignore[return-value]  # shape checked at creation

    def __repr__(self) -> str:
        return f"{self.shape}({self.fn.__qualname__})"


def gathered(fn: Callable[Concatenate[Any, P], R]) -> Remote[P, R]:
    """A method whose group call returns one result: DP_COMPUTE_PROTO (ranks' DataProtos concatenated),
    RANK_ZERO or `execute_mode=RANK_ZERO` (rank 0's output)."""
    return Remote(fn, "gathered")


def per_rank(fn: Callable[Concatenate[Any, P], R]) -> Remote[P, list[R]]:
    """A method whose group call returns one output per rank: ONE_TO_ALL, ALL_TO_ALL (every rank),
    DP_COMPUTE_METRIC (the collected rank of each dp rank)."""
    return Remote(fn, "per_rank")


def future(fn: Callable[Concatenate[Any, P], Any]) -> Remote[P, GroupFuture]:
    """A `blocking=False` method: the group call returns a `GroupFuture` at once."""
    return Remote(fn, "future")


def expected_shape(spec: RegisterSpec) -> Shape | None:
    """The helper a method registered with `spec` must be declared with (None: a custom mode, any shape)."""
    if not spec.blocking:
        return "future"
    mode = DISPATCH_MODES[spec.dispatch_mode] if spec.dispatch_mode in DISPATCH_MODES else None
    if spec.execute_mode is Execute.RANK_ZERO or (mode is not None and mode.rank_zero_only):
        return "gathered"
    return None if mode is None else mode.result


class RoleGroup:
    """Base of the typed handles: `Handle(wg)` checks `wg`'s worker class and forwards each declared method to it.

    `worker_group` is the underlying `WorkerGroup` (world size, shutdown, generic calls)."""

    worker_cls: ClassVar[type]

    def __init__(self, worker_group: WorkerGroup) -> None:
        check_role_group(type(self), worker_group.worker_cls)
        self.worker_group = worker_group

    @classmethod
    def remotes(cls) -> dict[str, Remote[Any, Any]]:
        """Attribute name → declared remote method, inherited declarations included."""
        found: dict[str, Remote[Any, Any]] = {}
        for klass in reversed(cls.__mro__):
            found |= {k: v for k, v in vars(klass).items() if isinstance(v, Remote)}
        return found

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.worker_group!r})"


_CHECKED: set[tuple[type, type]] = set()  # (handle, worker) pairs already found to match


def check_role_group(handle_cls: type[RoleGroup], worker_cls: type) -> None:
    """Raise `TypeError` unless `handle_cls` declares exactly `worker_cls`'s registered methods, each under its
    own name, with the worker's signature and the result shape its dispatch mode gives."""
    if (handle_cls, worker_cls) in _CHECKED:
        return
    where = f"{handle_cls.__name__} (handle of {worker_cls.__name__})"
    base = getattr(handle_cls, "worker_cls", None)
    if base is None or not (isinstance(worker_cls, type) and issubclass(worker_cls, base)):
        raise TypeError(f"{where}: the group runs {worker_cls.__name__}, not a subclass of the handle's worker_cls "
                        f"{getattr(base, '__name__', base)}; wrap it in the handle declared for its worker class")
    registered, declared = registered_methods(worker_cls), handle_cls.remotes()
    problems = [_check_one(worker_cls, name, spec, declared.get(name)) for name, spec in sorted(registered.items())]
    problems += [f"declares {name} but {worker_cls.__name__} has no @register-ed method {name!r}; remove it or "
                 f"register the worker method" for name in sorted(set(declared) - set(registered))]
    problems += [f"declares {attr} = {r!r}: the attribute must have the worker method's name, {r.name!r}"
                 for attr, r in sorted(declared.items()) if r.name != attr]
    problems = [p for p in problems if p]
    if problems:
        raise TypeError(f"{where} does not match the worker's registered methods:\n  " + "\n  ".join(problems))
    _CHECKED.add((handle_cls, worker_cls))


def _check_one(worker_cls: type, name: str, spec: RegisterSpec, remote: Remote[Any, Any] | None) -> str:
    actual = _function(worker_cls, name)
    shape = expected_shape(spec) or "gathered"
    if remote is None:
        return (f"{worker_cls.__name__}.{name}{_signature(actual)} is @register-ed but not declared: add "
                f"`{name} = {shape}({worker_cls.__name__}.{name})`")
    if remote.fn is not actual and _signature(remote.fn) != _signature(actual):
        return (f"{name}: declared from {remote.fn.__qualname__}{_signature(remote.fn)} but "
                f"{worker_cls.__name__}.{name} is {_signature(actual)}; declare it from the worker's own method")
    want = expected_shape(spec)
    if want is not None and remote.shape != want:
        return (f"{name}: registered with dispatch_mode={spec.dispatch_mode!r}, blocking={spec.blocking}, whose "
                f"group call returns {_SHAPE_RESULT[want]}; declare it as `{name} = {want}(...)`, not {remote.shape}")
    return ""


_SHAPE_RESULT = {"gathered": "one result", "per_rank": "a list with one result per rank", "future": "a GroupFuture"}


def _function(cls: type, name: str) -> Callable[..., Any]:
    attr = inspect.getattr_static(cls, name)
    return getattr(attr, "__func__", attr)


class _Annotation(str):
    """A string annotation (`from __future__ import annotations`) that prints as written, without quotes."""

    def __repr__(self) -> str:
        return str(self)


def _signature(fn: Callable[..., Any]) -> str:
    sig = inspect.signature(fn)

    def bare(ann: Any) -> Any:
        return _Annotation(ann) if isinstance(ann, str) else ann

    params = [p.replace(annotation=bare(p.annotation)) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=bare(sig.return_annotation)))
