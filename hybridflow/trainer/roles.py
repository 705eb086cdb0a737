"""Build the worker groups a PPO/GRPO run needs from the config: colocated in one process per GPU (default) or
one process per role, on the local backend (one process) or Ray.

This is the one place that maps roles to worker classes, typed handles and resource pools. The trainer holds the
handles (`ActorRolloutRefGroup`, ...): each is checked against its worker class here, at group creation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from hybridflow.config import Config, Resolved
from hybridflow.controller import (
    Backend,
    ResourcePool,
    RoleGroup,
    Worker,
    WorkerGroup,
    build_backend,
    create_colocated_worker_cls,
    spawn,
)
from hybridflow.workers.actor_rollout_ref import ActorRolloutRefGroup, ActorRolloutRefWorker
from hybridflow.workers.critic import CriticGroup, CriticWorker
from hybridflow.workers.reward_model import RewardModelGroup, RewardModelWorker
from hybridflow.workers.rollout_worker import RolloutGroup, RolloutWorker


class Role(NamedTuple):
    worker_cls: type[Worker]
    handle_cls: type[RoleGroup]


ROLES: dict[str, Role] = {
    "actor_rollout_ref": Role(ActorRolloutRefWorker, ActorRolloutRefGroup),
    "critic": Role(CriticWorker, CriticGroup),
    "reward_model": Role(RewardModelWorker, RewardModelGroup),
    "rollout": Role(RolloutWorker, RolloutGroup),  # non-sync modes only, in its own pool
}


@dataclass
class WorkerGroups:
    actor: ActorRolloutRefGroup
    critic: CriticGroup | None = None
    reward_model: RewardModelGroup | None = None
    pool: ResourcePool | None = None
    owners: tuple[WorkerGroup, ...] = ()  # the groups that own processes (one when colocated)
    rollout: RolloutGroup | None = None  # trainer.mode=one_step_off|async: the separate generation workers
    rollout_pool: ResourcePool | None = None

    def close(self) -> None:
        groups = self.owners + ((self.rollout.worker_group,) if self.rollout is not None else ())
        for wg in groups:
            wg.shutdown()
        for pool in (self.pool, self.rollout_pool):
            if pool is not None:
                pool.release()


def role_classes(res: Resolved) -> dict[str, type[Worker]]:
    names = ["actor_rollout_ref"]
    if res.use_critic:
        names.append("critic")
    if res.use_reward_model:
        names.append("reward_model")
    return {name: ROLES[name].worker_cls for name in names}


def pool_backend(cfg: Config, pool: ResourcePool) -> Backend:
    """`trainer.backend` for the groups on `pool` (Ray joins the cluster at `trainer.ray_address` when set)."""
    return build_backend(cfg.trainer.backend, pool.world_size, cfg.trainer.ray_address)


def build_worker_groups(cfg: Config, res: Resolved, total_training_steps: int | None = None) -> WorkerGroups:
    pool = ResourcePool.from_config(cfg)
    backend = pool_backend(cfg, pool)
    roles = role_classes(res)
    if cfg.trainer.use_colocated_worker:
        cls = create_colocated_worker_cls({name: (worker_cls, (cfg,), {}) for name, worker_cls in roles.items()})
        owner = WorkerGroup(pool, cls, backend=backend, name="colocated")
        views = spawn(owner)
        owners: tuple[WorkerGroup, ...] = (owner,)
    else:
        views = {name: WorkerGroup(pool, worker_cls, cfg, backend=backend, name=name)
                 for name, worker_cls in roles.items()}
        owners = tuple(views.values())
    actor = ActorRolloutRefGroup(views["actor_rollout_ref"])
    critic = CriticGroup(views["critic"]) if "critic" in views else None
    reward_model = RewardModelGroup(views["reward_model"]) if "reward_model" in views else None
    # trained roles size their LR schedule by the run's length
    actor.init_model(total_training_steps=total_training_steps)
    if critic is not None:
        critic.init_model(total_training_steps=total_training_steps)
    if reward_model is not None:
        reward_model.init_model()
    groups = WorkerGroups(actor=actor, critic=critic, reward_model=reward_model, pool=pool, owners=owners)
    if cfg.trainer.mode != "sync":
        try:
            groups.rollout, groups.rollout_pool = build_rollout_group(cfg)
        except BaseException:
            groups.close()  # the trainer's workers are up: release them before raising
            raise
    return groups


def build_rollout_group(cfg: Config) -> tuple[RolloutGroup, ResourcePool]:
    """The non-sync modes' generation workers: their own pool (`resource_pool.rollout_process_on_nodes`), so they
    are separate processes on the Ray backend (on the local backend, a second in-process worker)."""
    base = ResourcePool.from_config(cfg)
    pool = ResourcePool(list(cfg.resource_pool.rollout_process_on_nodes), 1, base.use_gpu, "rollout_pool")
    rollout = RolloutGroup(WorkerGroup(pool, RolloutWorker, cfg, backend=pool_backend(cfg, pool), name="rollout"))
    rollout.init_model()
    return rollout, pool
