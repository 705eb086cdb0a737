"""Build the worker groups a PPO/GRPO run needs from the config: colocated in one process per GPU (default) or
one process per role, on the local backend (one process) or Ray.

This is the one place that maps roles to worker classes and resource pools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.config import Config, Resolved
from hybridflow.controller import ResourcePool, WorkerGroup, create_colocated_worker_cls, spawn
from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.reward_model import RewardModelWorker


@dataclass
class WorkerGroups:
    actor: Any
    critic: Any = None
    reward_model: Any = None
    pool: ResourcePool | None = None
    owners: tuple[Any, ...] = ()

    def close(self) -> None:
        for wg in self.owners:
            wg.shutdown()
        if self.pool is not None:
            self.pool.release()


def role_classes(res: Resolved) -> dict[str, type]:
    roles: dict[str, type] = {"actor_rollout_ref": ActorRolloutRefWorker}
    if res.use_critic:
        roles["critic"] = CriticWorker
    if res.use_reward_model:
        roles["reward_model"] = RewardModelWorker
    return roles


def build_worker_groups(cfg: Config, res: Resolved, total_training_steps: int | None = None) -> WorkerGroups:
    pool = ResourcePool.from_config(cfg)
    backend = cfg.trainer.backend
    roles = role_classes(res)
    if cfg.trainer.use_colocated_worker:
        cls = create_colocated_worker_cls({name: (worker_cls, (cfg,), {}) for name, worker_cls in roles.items()})
        owner = WorkerGroup(pool, cls, backend=backend, name="colocated")
        views = spawn(owner)
        owners: tuple[Any, ...] = (owner,)
    else:
        views = {name: WorkerGroup(pool, worker_cls, cfg, backend=backend, name=name)
                 for name, worker_cls in roles.items()}
        owners = tuple(views.values())
    for name, view in views.items():
        if name == "reward_model":
            view.init_model()
        else:  # trained roles size their LR schedule by the run's length
            view.init_model(total_training_steps=total_training_steps)
    return WorkerGroups(actor=views["actor_rollout_ref"], critic=views.get("critic"),
                        reward_model=views.get("reward_model"), pool=pool, owners=owners)
