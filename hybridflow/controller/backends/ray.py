"""Ray backend: one actor per rank, placed with one placement group per node (one bundle per GPU, or per CPU slot
on CPU-only clusters), each pinned to its node (`ray_nodes`: which node, checked against what it has); each actor
asks for 1/max_colocate_count of its bundle so colocated groups share a GPU.

Ranks are numbered node by node (`ray_nodes`); rank 0's node and a free port there are the torch.distributed
rendezvous. `ray.init` is called when Ray is not running yet (`trainer.ray_address`, else RAY_ADDRESS, joins a
running cluster).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridflow.controller.backends.base import Backend
from hybridflow.controller.backends.host import WorkerHost
from hybridflow.controller.backends.ray_nodes import (
    NODE_ID_LABEL,
    NodeSlots,
    assign_nodes,
    cluster_nodes,
    topology_line,
)
from hybridflow.controller.backends.ray_tensors import register_tensor_serializer
from hybridflow.controller.errors import RemoteCallError, WorkerError, WorkerTimeoutError
from hybridflow.controller.hang import active_timeout_s, active_watchdog
from hybridflow.controller.resource_pool import ResourcePool
from hybridflow.controller.worker import Worker, WorkerEnv, worker_base_env

logger = logging.getLogger(__name__)

# A driver whose workers are Ray actors only does small host-side tensor ops (rewards, advantages, metrics,
# concatenating the ranks' outputs). At torch's default of one intra-op thread per core each of those ops waits on a
# barrier of ~32 threads competing with the GPU workers' spinning threads: on 2 H200s the PPO driver's reward stage
# took 7-60 ms per step instead of 7-10 ms, the 0.5B step's median 1.023 s instead of 0.995 s (docs/history.md, "Two GPUs").
DRIVER_THREADS = 2


def init_ray(address: str | None = None, **kwargs: Any) -> None:
    """Start a local Ray instance unless Ray is running, or join the cluster at `address` (`trainer.ray_address`;
    else RAY_ADDRESS; "auto": the cluster `ray start` began on this machine — never joined implicitly, so a run does
    not land on another process's cluster); workers inherit `worker_base_env()` (the user's runtime_env env_vars
    win over it)."""
    if ray.is_initialized():
        return
    runtime_env = dict(kwargs.pop("runtime_env", None) or {})
    runtime_env["env_vars"] = {**worker_base_env(), **runtime_env.get("env_vars", {})}
    kwargs.setdefault("include_dashboard", False)
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        for key in ("num_cpus", "num_gpus"):
            if kwargs.pop(key, None) is not None:
                logger.warning("ignoring %s: joining the existing Ray cluster at %s", key, address)
        ray.init(address=address, runtime_env=runtime_env, **kwargs)
    else:  # a new local instance: never the cluster /tmp/ray/ray_current_cluster names (ray.init()'s default)
        ray.init(address="local", runtime_env=runtime_env, **kwargs)
    logger.info("Ray resources: %s", ray.cluster_resources())


class RayWorkerHost(WorkerHost):
    """The actor class: a `WorkerHost` that fetches `RemoteSlice` chunks with `ray.get`."""

    in_driver_process = False

    def __init__(self) -> None:
        super().__init__(fetch=ray.get)
        register_tensor_serializer()


_REMOTE_HOSTS: dict[tuple[tuple[str, int], ...], Any] = {}

# Every actor answers the hang watchdog (progress, stack dumps) on this one-thread group while its calls run. With
# any named group, Ray runs the default group's calls on one thread of its own (not the process's main thread).
WATCH_GROUP = "hybridflow_watch"


def _remote_host(concurrency_groups: dict[str, int] | None = None) -> Any:
    """The Ray actor class; Ray takes `concurrency_groups` only here (not in `.options()`), so one class per set."""
    groups = dict(concurrency_groups or {})
    if WATCH_GROUP in groups:
        raise ValueError(f"concurrency group name {WATCH_GROUP!r} is reserved for the hang watchdog; rename the "
                         f"worker's group")
    key = tuple(sorted({**groups, WATCH_GROUP: 1}.items()))
    if key not in _REMOTE_HOSTS:
        _REMOTE_HOSTS[key] = ray.remote(concurrency_groups=dict(key))(RayWorkerHost)
    return _REMOTE_HOSTS[key]


# Slots this driver's live pools hold per node id: a second pool (separate rollout workers, another role's own
# pool) is placed on what the first left free.
_HELD: dict[str, int] = {}


@dataclass
class _Placement:
    groups: list[PlacementGroup]  # one per node, in rank order
    nodes: list[NodeSlots]  # the node of each group
    use_gpu: bool

    def slots(self) -> list[tuple[PlacementGroup, int, NodeSlots]]:
        return [(pg, b, node) for pg, node in zip(self.groups, self.nodes) for b in range(pg.bundle_count)]


class RayBackend(Backend):
    kind = "ray"
    placement_timeout_s = 60.0
    start_timeout_s = 600.0  # includes the workers' __init__ (model loading)
    death_grace_s = 2.0  # how long a worker's exception waits for news of another rank's death (see _worker_error)

    def __init__(self, address: str | None = None) -> None:
        self.address = address  # the cluster to join when Ray is not running yet (None: RAY_ADDRESS or a new one)
        self._actor_nodes: dict[str, str] = {}  # actor id (hex) -> node label, to name the node of a dead rank

    # ---------------------------------------------------------------------------------------- placement
    def _placement(self, pool: ResourcePool) -> _Placement:
        state = pool._backend_state.get("ray")
        if state is not None:
            return state
        total = ray.cluster_resources()
        use_gpu = pool.use_gpu if pool.use_gpu is not None else total.get("GPU", 0) > 0
        kind = "GPU" if use_gpu else "CPU"
        nodes = cluster_nodes(ray.nodes(), kind, ray.get_runtime_context().get_node_id(), _HELD)
        chosen = assign_nodes(pool.name, pool.process_on_nodes, nodes, kind)
        bundle = {"CPU": 1.0, "GPU": 1.0} if use_gpu else {"CPU": 1.0}
        # Every bundle carries its node's id label, so a group is packed on that one node whatever the strategy;
        # PACK, because Ray's STRICT_PACK dropped bundle label selectors until early 2026 (ray-project/ray#60170).
        groups = [placement_group([dict(bundle) for _ in range(n)], strategy="PACK",
                                  bundle_label_selector=[{NODE_ID_LABEL: node.node_id} for _ in range(n)])
                  for n, node in zip(pool.process_on_nodes, chosen)]
        try:
            ray.get([pg.ready() for pg in groups], timeout=self.placement_timeout_s)
            _check_pinned(pool, groups, chosen)
        except BaseException as err:
            _remove_placement_groups(groups)
            if not isinstance(err, GetTimeoutError):
                raise
            raise RuntimeError(
                f"resource pool {pool.name!r}: placement groups for process_on_nodes={pool.process_on_nodes} "
                f"({kind} bundles) on nodes {[n.label for n in chosen]} were not scheduled within "
                f"{self.placement_timeout_s:g} s; available now: {ray.available_resources()} (another job or "
                f"driver may hold them: release them first)") from None
        placement = _Placement(groups, chosen, use_gpu)
        for node, n in zip(chosen, pool.process_on_nodes):
            _HELD[node.node_id] = _HELD.get(node.node_id, 0) + n
        pool._backend_state["ray"] = placement
        pool.on_release(functools.partial(_release, placement, list(pool.process_on_nodes)))
        return placement

    # -------------------------------------------------------------------------------------------- start
    def start(self, pool: ResourcePool, worker_cls: type[Worker], args: tuple[Any, ...], kwargs: dict[str, Any],
              group: str) -> list[Any]:
        init_ray(self.address)
        _limit_driver_threads()
        register_tensor_serializer()
        placement = self._placement(pool)
        if pool.groups_placed >= pool.max_colocate_count:
            raise ValueError(
                f"worker group {group!r}: resource pool {pool.name!r} already hosts {pool.groups_placed} group(s) and "
                f"max_colocate_count={pool.max_colocate_count}; colocate roles in one process with "
                f"create_colocated_worker_cls, raise resource_pool.max_colocate_count, or use another pool")
        share = 1.0 / pool.max_colocate_count
        options: dict[str, Any] = {"num_cpus": share, "num_gpus": share if placement.use_gpu else 0,
                                   "max_concurrency": 1}
        # named thread groups beside the default one (which keeps one thread: its calls run in order)
        groups = worker_cls.concurrency_groups(*args, **kwargs)
        runtime_env = _actor_runtime_env()
        if runtime_env is not None:
            options["runtime_env"] = runtime_env
        host_cls = _remote_host(groups)
        slots = placement.slots()
        hosts = [host_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, bundle), **options).remote()
                 for pg, bundle, _ in slots]
        ranks = list(range(len(hosts)))
        start = time.perf_counter()
        try:
            addr, port = self.wait([hosts[0].node_address.remote()], [0], group, "__init__", self.start_timeout_s)[0]
            process_s = time.perf_counter() - start
            payload = ray.put((worker_cls, args, kwargs))  # serialised once; Ray resolves it in each actor
            envs = [WorkerEnv(rank, len(hosts), bundle, pg.bundle_count, addr, port, active_timeout_s())
                    for rank, (pg, bundle, _) in enumerate(slots)]
            refs = [host.construct.remote(env, payload, True) for host, env in zip(hosts, envs)]
            self.wait(refs, ranks, group, "__init__", self.start_timeout_s)
        except BaseException:
            for host in hosts:
                ray.kill(host, no_restart=True)
            raise
        pool.groups_placed += 1
        self._actor_nodes.update((h._actor_id.hex(), node.label) for h, (_, _, node) in zip(hosts, slots))
        logger.info("worker group %r: %d actors up in %.2f s, workers constructed after %.2f s", group, len(hosts),
                    process_s, time.perf_counter() - start)
        logger.info("%s", topology_line(group, pool.name, placement.nodes, pool.process_on_nodes))
        return hosts

    # -------------------------------------------------------------------------------------------- calls
    def submit(self, handles: Sequence[Any], ranks: Sequence[int], target: str,
               per_rank_args: Sequence[tuple[Any, ...]], per_rank_kwargs: Sequence[dict[str, Any]],
               concurrency_group: str | None = None) -> list[Any]:
        return [(handles[r].call if concurrency_group is None else
                 handles[r].call.options(concurrency_group=concurrency_group)).remote(target, *a, **k)
                for r, a, k in zip(ranks, per_rank_args, per_rank_kwargs)]

    def wait(self, refs: Sequence[Any], ranks: Sequence[int], group: str, method: str,
             timeout_s: float | None) -> list[Any]:
        error: Exception
        try:
            watchdog = active_watchdog()
            if watchdog is None:
                return ray.get(list(refs), timeout=timeout_s)  # raises as soon as any rank fails
            return self._watched_get(refs, timeout_s, watchdog.poll_s)
        except GetTimeoutError:
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
            done = set(ready)
            pending = [rank for rank, ref in zip(ranks, refs) if ref not in done]
            error = WorkerTimeoutError(group, method, float(timeout_s or 0), pending)
        except RayError as err:
            error = self._worker_error(refs, ranks, group, method, err)
        # Raised outside the `except`: Ray's wrapper (whose text the error already carries) is not chained, but an
        # error already in flight is (a cleanup call in a trainer's `finally` after a worker died), where
        # `from None` hid it: the user saw only the cleanup's failure.
        raise error

    @staticmethod
    def _watched_get(refs: Sequence[Any], timeout_s: float | None, poll_s: float) -> list[Any]:
        """`ray.get` in slices of `poll_s`, raising the watchdog's `HangError` between slices once it fired."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return ray.get(list(refs), timeout=poll_s if left is None else min(poll_s, left))
            except GetTimeoutError:
                if left is not None and left <= poll_s:
                    raise
            watchdog = active_watchdog()
            if watchdog is not None:
                watchdog.raise_if_fired()

    def _worker_error(self, refs: Sequence[Any], ranks: Sequence[int], group: str, method: str,
                      err: RayError) -> WorkerError:
        """The error to raise: a rank whose process died comes first, since the exceptions of live ranks are often
        its echo (a collective that lost its peer: gloo raises "Connection reset by peer" at once, and can reach
        the driver before Ray reports the death), so a worker's own exception waits up to `death_grace_s` for the
        other ranks first; then that exception, with its traceback."""
        cause = getattr(err, "cause", None)
        if isinstance(cause, RemoteCallError) and len(refs) > 1:
            ray.wait(list(refs), num_returns=len(refs), timeout=self.death_grace_s)
        failures = _failures(refs, ranks)
        dead = [(rank, e) for rank, e in failures if isinstance(e, RayActorError)]
        if dead:  # the death Ray raised first (same actor), else the lowest dead rank
            first = getattr(err, "actor_id", None) if isinstance(err, RayActorError) else None
            rank, e = next(((r, x) for r, x in dead if first and getattr(x, "actor_id", None) == first), dead[0])
            echoes = [f"rank {r}: {_first_line(x)}" for r, x in failures if r != rank]
            detail = f"worker process failed ({type(e).__name__}): {e}"
            if echoes:
                detail += "\nafterwards (likely a consequence): " + "; ".join(echoes)
            return WorkerError(group, method, rank, detail, node=self._actor_nodes.get(str(e.actor_id), ""))
        if isinstance(cause, RemoteCallError):
            return WorkerError(group, method, cause.rank, cause.summary, cause.traceback_text)
        rank = failures[0][0] if failures else -1
        return WorkerError(group, method, rank, f"worker process failed ({type(err).__name__}): {err}")

    def ready(self, refs: Sequence[Any]) -> bool:
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        return len(ready) == len(refs)

    def progress(self, handles: Sequence[Any], timeout_s: float) -> list[dict[str, Any] | None]:
        return _watch_call(handles, "progress", timeout_s, None)

    def dump_stacks(self, handles: Sequence[Any], timeout_s: float) -> list[str]:
        return _watch_call(handles, "dump_stacks", timeout_s,
                           f"(no answer within {timeout_s:g} s: the process is dead or a thread holds the GIL)")

    def stop(self, handles: Sequence[Any], pool: ResourcePool) -> None:
        for host in handles:
            ray.kill(host, no_restart=True)
        pool.groups_placed = max(0, pool.groups_placed - 1)


def _watch_call(handles: Sequence[Any], method: str, timeout_s: float, missing: Any) -> list[Any]:
    """`method` on every actor's watch thread; `missing` for an actor that did not answer in time or died."""
    refs = [getattr(h, method).options(concurrency_group=WATCH_GROUP).remote() for h in handles]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    done, out = set(ready), []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=0) if ref in done else missing)
        except RayError as err:
            logger.debug("hang watchdog: %s failed: %s", method, err)
            out.append(missing)
    return out


def _limit_driver_threads() -> None:
    """Cap this process's torch intra-op threads: it drives Ray actors, which do the heavy work."""
    if torch.get_num_threads() > DRIVER_THREADS:
        logger.info("driver: torch intra-op threads %d -> %d (the workers are Ray actors)", torch.get_num_threads(),
                    DRIVER_THREADS)
        torch.set_num_threads(DRIVER_THREADS)


def _remove_placement_groups(groups: list[PlacementGroup]) -> None:
    for pg in groups:
        remove_placement_group(pg)


def _release(placement: _Placement, process_on_nodes: list[int]) -> None:
    for node, n in zip(placement.nodes, process_on_nodes):
        _HELD[node.node_id] = max(0, _HELD.get(node.node_id, 0) - n)
    _remove_placement_groups(placement.groups)


def _check_pinned(pool: ResourcePool, groups: list[PlacementGroup], nodes: list[NodeSlots]) -> None:
    """Every bundle landed on its group's node (a Ray that ignores bundle label selectors would break the ranks'
    node order silently)."""
    for i, (pg, node) in enumerate(zip(groups, nodes)):
        landed = set(placement_group_table(pg)["bundles_to_node_id"].values())
        if landed != {node.node_id}:
            raise RuntimeError(f"resource pool {pool.name!r}: node {i}'s placement group was asked for node "
                               f"{node.label} but landed on {sorted(landed)}; this Ray ignores bundle label "
                               f"selectors: upgrade it (pip install -U 'ray[default]')")


def _actor_runtime_env() -> dict[str, Any] | None:
    """Per-actor env vars only when the job's runtime_env lacks some (per-actor runtime envs start slower)."""
    job_env = ray.get_runtime_context().runtime_env.get("env_vars") or {}
    missing = {k: v for k, v in worker_base_env().items() if k not in job_env}  # the job's own values win
    if not missing:
        return None
    return {"env_vars": {**job_env, **missing}}


def _failures(refs: Sequence[Any], ranks: Sequence[int]) -> list[tuple[int, RayError]]:
    """(rank, error) of every finished call that failed, in rank order."""
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
    done = set(ready)
    out = []
    for rank, ref in zip(ranks, refs):
        if ref in done:
            try:
                ray.get(ref, timeout=0)
            except RayError as e:
                out.append((rank, e))
    return out


def _first_line(e: BaseException) -> str:
    """`Type: first line` of a failure; a worker's own exception rather than Ray's wrapper of it."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, RemoteCallError):
        return cause.summary.splitlines()[0][:200] if cause.summary else type(cause).__name__
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"
