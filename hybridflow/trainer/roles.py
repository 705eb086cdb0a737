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
    ResourcePool,
    RoleGroup,
    Worker,
    WorkerGroup,
    create_colocated_worker_cls,
    spawn,
)
from hybridflow.workers.actor_rollout_ref import ActorRolloutRefGroup, ActorRolloutRefWorker
from hybridflow.workers.critic import CriticGroup, CriticWorker
from hybridflow.workers.reward_model import RewardModelGroup, RewardModelWorker


class Role(NamedTuple):
    worker_cls: type[Worker]
    handle_cls: type[RoleGroup]


ROLES: dict[str, Role] = {
    "actor_rollout_ref": Role(ActorRolloutRefWorker, ActorRolloutRefGroup),
    "critic": Role(CriticWorker, CriticGroup),
    "reward_model": Role(RewardModelWorker, RewardModelGroup),
}


@dataclass
class WorkerGroups:
    actor: ActorRolloutRefGroup
    critic: CriticGroup | None = None
    reward_model: RewardModelGroup | None = None
    pool: ResourcePool | None = None
    owners: tuple[WorkerGroup, ...] = ()  # the groups that own processes (one when colocated)

    def close(self) -> None:
        for wg in self.owners:
            wg.shutdown()
        if self.pool is not None:
            self.pool.release()


def role_classes(res: Resolved) -> dict[str, type[Worker]]:
    names = ["actor_rollout_ref"]
    if res.use_critic:
        names.append("critic")
    if res.use_reward_model:
        names.append("reward_model")
    return {name: ROLES[name].worker_cls for name in names}


def build_worker_groups(cfg: Config, res: Resolved, total_training_steps: int | None = None) -> WorkerGroups:
    pool = ResourcePool.from_config(cfg)
    backend = cfg.trainer.backend
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
    return WorkerGroups(actor=actor, critic=critic, reward_model=reward_model, pool=pool, owners=owners)
