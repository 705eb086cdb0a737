"""Colocation: several roles (actor/rollout, critic, reference, ...) in one worker process per GPU.

`create_colocated_worker_cls` builds one `Worker` class that constructs every role in the same process (one CUDA
context, weights shared without copies) and exposes each role's registered methods as `<role>__<method>`;
`spawn(wg)` returns per-role WorkerGroup views whose methods route to their role. `create_role_groups` is the
one switch between that layout and one group (own processes, own pool) per role (`trainer.use_colocated_worker`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hybridflow.controller.backends import Backend
from hybridflow.controller.decorator import REGISTER_ATTR, RegisterSpec, registered_methods
from hybridflow.controller.resource_pool import ResourcePool
from hybridflow.controller.worker import DispatchInfo, Worker
from hybridflow.controller.worker_group import WorkerGroup

RoleSpec = type[Worker] | tuple[type[Worker], tuple[Any, ...]] | tuple[type[Worker], tuple[Any, ...], dict[str, Any]]


class ColocatedWorker(Worker):
    """Base of the classes `create_colocated_worker_cls` builds; `roles` maps role name → role worker."""

    _hf_roles: dict[str, tuple[type[Worker], tuple[Any, ...], dict[str, Any]]] = {}
    _hf_method_roles: dict[str, str] = {}

    def __init__(self) -> None:
        super().__init__()
        self.roles: dict[str, Worker] = {}
        for role, (cls, args, kwargs) in self._hf_roles.items():
            self.roles[role] = cls(*args, **kwargs)
        for worker in self.roles.values():  # a role may act for the whole process (e.g. one checkpoint)
            worker.colocated_roles = self.roles  # type: ignore[attr-defined]

    def get_dispatch_info(self, role: str | None = None) -> DispatchInfo:
        return super().get_dispatch_info() if role is None else self.roles[role].get_dispatch_info()

    def role_call(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.roles[role], method)(*args, **kwargs)


def _normalize(role: str, spec: Any) -> tuple[type[Worker], tuple[Any, ...], dict[str, Any]]:
    if isinstance(spec, type):
        cls, args, kwargs = spec, (), {}
    elif isinstance(spec, tuple) and 1 <= len(spec) <= 3:
        cls, args, kwargs = spec[0], tuple(spec[1]) if len(spec) > 1 else (), dict(spec[2]) if len(spec) > 2 else {}
    else:
        raise TypeError(f"colocated role {role!r}: expected a Worker class or (cls, args[, kwargs]), got {spec!r}")
    if not (isinstance(cls, type) and issubclass(cls, Worker)):
        raise TypeError(f"colocated role {role!r}: {cls!r} is not a Worker subclass")
    if not role.isidentifier() or "__" in role:
        raise ValueError(f"colocated role name {role!r} must be a Python identifier without '__'")
    return cls, args, kwargs


def _forwarder(role: str, method: str, spec: RegisterSpec) -> Callable[..., Any]:
    def forward(self: ColocatedWorker, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.roles[role], method)(*args, **kwargs)

    forward.__name__ = f"{role}__{method}"
    setattr(forward, REGISTER_ATTR, spec)
    return forward


def create_colocated_worker_cls(roles: Mapping[str, RoleSpec]) -> type[ColocatedWorker]:
    """One worker class hosting every role: `{"actor_rollout": (ActorCls, (cfg,)), "critic": CriticCls}`.

    Role constructors run in the order given, in the same process, each as a normal `Worker` (same rank).
    """
    if not roles:
        raise ValueError("create_colocated_worker_cls: give at least one role, e.g. {'actor_rollout': ActorCls}")
    normalized = {role: _normalize(role, spec) for role, spec in roles.items()}
    attrs: dict[str, Any] = {"_hf_roles": normalized, "_hf_method_roles": {}}
    for role, (cls, _, _) in normalized.items():
        for method, spec in registered_methods(cls).items():
            name = f"{role}__{method}"
            attrs[name] = _forwarder(role, method, spec)
            attrs["_hf_method_roles"][name] = role
    return type(f"Colocated_{'_'.join(normalized)}", (ColocatedWorker,), attrs)


def spawn(wg: WorkerGroup) -> dict[str, WorkerGroup]:
    """Per-role views of a colocated group: `spawn(wg)["critic"].compute_values(data)`."""
    roles = getattr(wg._worker_cls, "_hf_roles", None)
    if not roles:
        raise ValueError(f"worker group {wg.name!r} is not colocated; build its class with "
                         f"create_colocated_worker_cls")
    return {role: wg.role_view(role) for role in roles}


def create_role_groups(roles: Mapping[str, RoleSpec], pools: ResourcePool | Mapping[str, ResourcePool], *,
                       colocate: bool = True, backend: str | Backend = "auto") -> dict[str, WorkerGroup]:
    """Role name → WorkerGroup: views of one colocated group (`colocate=True`, one pool), or one group per role,
    each on `pools[role]` (`colocate=False`; a single pool is shared when its max_colocate_count allows)."""
    if colocate:
        if not isinstance(pools, ResourcePool):
            raise ValueError("create_role_groups(colocate=True) places every role in one process per slot: pass "
                             "one ResourcePool, not a mapping of pools")
        return spawn(WorkerGroup(pools, create_colocated_worker_cls(roles), backend=backend, name="+".join(roles)))
    groups: dict[str, WorkerGroup] = {}
    for role, spec in roles.items():
        cls, args, kwargs = _normalize(role, spec)
        if isinstance(pools, ResourcePool):
            pool = pools
        elif role in pools:
            pool = pools[role]
        else:
            raise ValueError(f"create_role_groups: no resource pool for role {role!r}; pools given for "
                             f"{sorted(pools)}")
        groups[role] = WorkerGroup(pool, cls, *args, backend=backend, name=role, **kwargs)
    return groups
