"""Single controller: workers, `@register` dispatch, worker groups, resource pools, colocation, backends."""

from hybridflow.controller.backends import Backend, build_backend
from hybridflow.controller.colocate import (
    ColocatedWorker,
    create_colocated_worker_cls,
    create_role_groups,
    spawn,
)
from hybridflow.controller.decorator import (
    DISPATCH_MODES,
    Dispatch,
    DispatchContext,
    DispatchPlan,
    Execute,
    register,
    register_dispatch_mode,
)
from hybridflow.controller.errors import WorkerError, WorkerTimeoutError
from hybridflow.controller.futures import GroupFuture
from hybridflow.controller.proxy import RoleGroup, check_role_group, future, gathered, per_rank
from hybridflow.controller.resource_pool import ResourcePool
from hybridflow.controller.worker import DispatchInfo, Worker, WorkerEnv
from hybridflow.controller.worker_group import WorkerGroup

__all__ = [
    "Backend", "build_backend", "ColocatedWorker", "create_colocated_worker_cls", "create_role_groups",
    "spawn", "DISPATCH_MODES",
    "Dispatch", "DispatchContext", "DispatchPlan", "Execute", "register", "register_dispatch_mode", "WorkerError",
    "WorkerTimeoutError", "GroupFuture", "ResourcePool", "DispatchInfo", "Worker", "WorkerEnv", "WorkerGroup",
    "RoleGroup", "check_role_group", "future", "gathered", "per_rank",
]
