"""`WorkerGroup`: the driver-side handle of N workers; every `@register`-ed worker method becomes a group method.

`wg.update_actor(data)` = dispatch (split per rank) → call every rank (backend) → collect (gather). Methods
registered with `blocking=False` return a `GroupFuture` that can be passed straight into the next call. A group
built from a colocated worker class also gives per-role views (`role_view`, or `colocate.spawn`) that share its
processes. The attributes are untyped; trainers hold a typed handle instead (`controller.proxy.RoleGroup`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from hybridflow.controller.backends import Backend, build_backend
from hybridflow.controller.decorator import (
    DISPATCH_MODES,
    DispatchContext,
    DispatchMode,
    Execute,
    RegisterSpec,
    registered_methods,
)
from hybridflow.controller.futures import GroupFuture, ProtoLayout
from hybridflow.controller.hang import active_watchdog
from hybridflow.controller.resource_pool import ResourcePool
from hybridflow.controller.worker import DispatchInfo, Worker

logger = logging.getLogger(__name__)

_RANK0 = [0]


class BoundMethod:
    """`wg.<name>`: calls the worker method `target` on the group's ranks with the method's dispatch mode."""


    def __init__(self, group: WorkerGroup, name: str, target: str, spec: RegisterSpec, mode: DispatchMode,
                 ctx: DispatchContext, doc: str | None) -> None:
        self.group, self.name, self.target, self.spec, self.mode, self.ctx = group, name, target, spec, mode, ctx
        self.__doc__ = doc

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.group._call(self, args, kwargs)

    def __repr__(self) -> str:
        return f"<{self.group.name}.{self.name} dispatch={self.mode.name} blocking={self.spec.blocking}>"


class WorkerGroup:
    """`WorkerGroup(pool, WorkerCls, *args, backend="auto", name=None, **kwargs)` starts one
    `WorkerCls(*args, **kwargs)` per rank of `pool` (None = one local process) and binds its registered methods.

    `default_timeout_s` bounds calls whose method has no `register(timeout_s=...)` (None = wait forever; a
    failing or dying worker still raises at once).
    """

    def __init__(self, resource_pool: ResourcePool | None, worker_cls: type[Worker] | functools.partial[Worker],
                 *args: Any, backend: str | Backend = "auto", name: str | None = None, **kwargs: Any) -> None:
        cls, args, kwargs = _unwrap_class(worker_cls, args, kwargs)
        pool = resource_pool if resource_pool is not None else ResourcePool([1], name="local_pool")
        self._backend = backend if isinstance(backend, Backend) else build_backend(backend, pool.world_size)
        self.name = name or cls.__name__
        self._pool, self._worker_cls = pool, cls
        self._handles = self._backend.start(pool, cls, args, kwargs, self.name)
        self._alive = [True]  # shared with role views
        watchdog = active_watchdog()
        if watchdog is not None:
            watchdog.watch(self.name, self._backend, self._handles)
        self._role: str | None = None
        self._bind(cls, role=None)
        logger.info("worker group %r: %d %s worker(s) of %s", self.name, self.world_size, self._backend.kind,
                    cls.__name__)

    # ---------------------------------------------------------------------------------------------- binding
    def _bind(self, cls: type, role: str | None) -> None:
        self._ranks = list(range(len(self._handles)))
        self.default_timeout_s: float | None = None
        self._contexts: dict[str | None, DispatchContext] = {}
        self._methods: dict[str, BoundMethod] = {}
        method_roles: dict[str, str] = getattr(cls, "_hf_method_roles", {}) if role is None else {}
        for mname, spec in registered_methods(cls).items():
            try:
                mode = DISPATCH_MODES[spec.dispatch_mode]
            except KeyError as err:
                raise ValueError(f"{cls.__name__}.{mname}: {err.args[0]}; register custom modes with "
                                 f"register_dispatch_mode before creating the group") from None
            if hasattr(WorkerGroup, mname) or mname in vars(self):
                raise ValueError(f"{cls.__name__}.{mname}: the name collides with WorkerGroup.{mname}; rename the "
                                 f"worker method")
            method_role = role if role is not None else method_roles.get(mname)
            target = f"{role}__{mname}" if role is not None else mname
            doc = getattr(getattr(cls, mname, None), "__doc__", None)
            bound = BoundMethod(self, mname, target, spec, mode, self._context(method_role), doc)
            self._methods[mname] = bound
            setattr(self, mname, bound)

    def _context(self, role: str | None) -> DispatchContext:
        ctx = self._contexts.get(role)
        if ctx is None:
            where = f"worker group {self.name!r}" + (f" role {role!r}" if role else "")
            ctx = DispatchContext(len(self._handles), self._backend.kind,
                                  functools.partial(self._query_dispatch_info, role), where)
            self._contexts[role] = ctx
        return ctx

    def _query_dispatch_info(self, role: str | None) -> list[DispatchInfo]:
        args = (role,) if role is not None else ()
        refs = self._backend.submit(self._handles, self._ranks, "get_dispatch_info", [args] * self.world_size,
                                    [{}] * self.world_size)
        return self._backend.wait(refs, self._ranks, self.name, "get_dispatch_info", self.default_timeout_s)

    # ------------------------------------------------------------------------------------------------ calls
    def _call(self, method: BoundMethod, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._alive[0]:
            raise RuntimeError(f"worker group {self.name!r} was shut down; cannot call {method.name!r}")
        mode, spec, ctx = method.mode, method.spec, method.ctx
        if not mode.takes_futures:
            args, kwargs = _resolve_futures(args, kwargs)
        plan = mode.dispatch(ctx, args, kwargs)
        rank_zero = mode.rank_zero_only or spec.execute_mode is Execute.RANK_ZERO
        if rank_zero:
            ranks, per_args, per_kwargs = _RANK0, plan.args[:1], plan.kwargs[:1]
        else:
            ranks, per_args, per_kwargs = self._ranks, plan.args, plan.kwargs
            if len(per_args) != len(ranks) or len(per_kwargs) != len(ranks):
                raise ValueError(f"dispatch mode {mode.name!r} gave {len(per_args)} args / {len(per_kwargs)} kwargs "
                                 f"entries for {len(ranks)} ranks; return one per rank")
        refs = self._backend.submit(self._handles, ranks, method.target, per_args, per_kwargs, spec.concurrency_group)
        timeout = spec.timeout_s if spec.timeout_s is not None else self.default_timeout_s
        finish: Callable[[list[Any]], Any] = (
            _first if rank_zero else functools.partial(_collect, mode, ctx, plan.state))
        if spec.blocking:
            return finish(self._backend.wait(refs, ranks, self.name, method.name, timeout))
        layout = None
        if mode.chains_proto and plan.rows is not None and not rank_zero:
            dp = ctx.dp_layout
            layout = ProtoLayout(self._backend.kind, [refs[r] for r in dp.collect_ranks], dp.dp_size, *plan.rows)
        return GroupFuture(self._backend, self.name, method.name, refs, ranks, finish, layout, timeout)

    def execute_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call any worker method (registered or not) on every rank with the same args; list of outputs."""
        target, call_args = method, args
        if self._role is not None:
            target, call_args = "role_call", (self._role, method, *args)
        refs = self._backend.submit(self._handles, self._ranks, target, [call_args] * self.world_size,
                                    [kwargs] * self.world_size)
        return self._backend.wait(refs, self._ranks, self.name, method, self.default_timeout_s)

    @staticmethod
    def wait(futures: GroupFuture | Sequence[GroupFuture], timeout_s: float | None = None) -> Any:
        """`fut.get()` for one future, a list of results for several."""
        if isinstance(futures, GroupFuture):
            return futures.get(timeout_s)
        return [f.get(timeout_s) for f in futures]

    def refresh_dispatch_info(self) -> None:
        """Re-read every rank's DispatchInfo before the next data-parallel call (after set_dispatch_info)."""
        for ctx in self._contexts.values():
            ctx.refresh()

    # ------------------------------------------------------------------------------------------- structure
    @property
    def world_size(self) -> int:
        return len(self._handles)

    @property
    def backend_kind(self) -> str:
        return self._backend.kind

    @property
    def resource_pool(self) -> ResourcePool:
        return self._pool

    @property
    def method_names(self) -> list[str]:
        return list(self._methods)

    @property
    def worker_cls(self) -> type[Worker]:
        """The class each rank runs (a role view: that role's class)."""
        return self._worker_cls

    def method(self, name: str) -> BoundMethod:
        """The group method that runs the worker's registered method `name`."""
        try:
            return self._methods[name]
        except KeyError:
            raise AttributeError(f"worker group {self.name!r} has no registered method {name!r}; registered: "
                                 f"{sorted(self._methods)}") from None

    def role_view(self, role: str) -> WorkerGroup:
        """A WorkerGroup over the same processes whose methods are those of one colocated role."""
        roles: dict[str, Any] = getattr(self._worker_cls, "_hf_roles", {})
        if role not in roles:
            raise KeyError(f"worker group {self.name!r} has no role {role!r}; roles: {sorted(roles) or 'none'} "
                           f"(build the worker class with create_colocated_worker_cls)")
        view = object.__new__(WorkerGroup)
        view._backend, view._handles, view._pool, view._alive = self._backend, self._handles, self._pool, self._alive
        view.name, view._worker_cls, view._role = f"{self.name}/{role}", roles[role][0], role
        view._bind(roles[role][0], role=role)
        return view

    def shutdown(self) -> None:
        """Stop the workers (shared with every role view); idempotent. The pool stays allocated."""
        if self._alive[0]:
            self._alive[0] = False
            watchdog = active_watchdog()
            if watchdog is not None:
                watchdog.unwatch(self._handles)
            self._backend.stop(self._handles, self._pool)

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (f"WorkerGroup({self.name!r}, world_size={self.world_size}, backend={self._backend.kind}, "
                f"methods={list(self._methods)})")


def _first(outputs: list[Any]) -> Any:
    return outputs[0]


def _collect(mode: DispatchMode, ctx: DispatchContext, state: Any, outputs: list[Any]) -> Any:
    return mode.collect(ctx, outputs, state)


def _resolve_futures(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if any(isinstance(a, GroupFuture) for a in args):
        args = tuple(a.get() if isinstance(a, GroupFuture) else a for a in args)
    if any(isinstance(v, GroupFuture) for v in kwargs.values()):
        kwargs = {k: v.get() if isinstance(v, GroupFuture) else v for k, v in kwargs.items()}
    return args, kwargs


def _unwrap_class(worker_cls: Any, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> tuple[type[Worker], tuple[Any, ...], dict[str, Any]]:
    if isinstance(worker_cls, functools.partial):
        args, kwargs = (*worker_cls.args, *args), {**worker_cls.keywords, **kwargs}
        worker_cls = worker_cls.func
    if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
        raise TypeError(f"WorkerGroup needs a Worker subclass (or functools.partial of one), got {worker_cls!r}")
    return worker_cls, args, kwargs
