"""`CriticWorker`: value model (actor backbone + scalar head) trained with the clipped value loss; the driver
holds a `CriticGroup`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hybridflow.checkpoint.worker import CheckpointingGroup, CheckpointingWorker
from hybridflow.config import Config, resolve
from hybridflow.controller import Dispatch, Worker, gathered, per_rank, register
from hybridflow.engine import TrainEngine, train_update
from hybridflow.protocol import DataProto, keys
from hybridflow.workers.engine_specs import VALUES, critic_plan, critic_spec
from hybridflow.workers.losses import make_critic_loss

if TYPE_CHECKING:
    from hybridflow.engine import TrainEngine


class CriticWorker(CheckpointingWorker, Worker):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.critic: TrainEngine  # built by init_model

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, total_training_steps: int | None = None) -> None:
        self.init_distributed()
        cfg = self.cfg
        torch.manual_seed(self.cfg.trainer.seed)  # the new scalar head is randomly initialised
        self.critic = TrainEngine(critic_spec(cfg, total_training_steps), device=self.device)
        self.loss_fn = make_critic_loss(self.cfg.critic, self.cfg.data.max_response_length)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @keys.checked_stage(keys.VALUES_STAGE)
    def compute_values(self, data: DataProto, beside: Callable[[], object] | None = None) -> DataProto:
        """`beside`: host work of the driver, run once the forwards are queued (in-process workers only)."""
        values = self.critic.infer(data, VALUES, beside=beside)[keys.VALUES]
        return DataProto.from_dict({keys.VALUES: values})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    @keys.checked_stage(keys.UPDATE_CRITIC)
    def update_critic(self, data: DataProto) -> dict[str, float]:
        plan = critic_plan(self.cfg, resolve(self.cfg).critic)
        metrics = train_update(self.critic, data, self.loss_fn, VALUES, plan)
        metrics = {(k if "/" in k else f"critic/{k}"): v for k, v in metrics.items()}
        if torch.cuda.is_available():
            metrics["perf/max_memory_allocated_gb/critic"] = torch.cuda.max_memory_allocated() / 2**30
        return metrics

    def checkpoint_engines(self) -> dict[str, TrainEngine]:
        return {"critic": self.critic}


class CriticGroup(CheckpointingGroup):
    """Driver-side handle of a `CriticWorker` group (or colocated role view)."""

    worker_cls = CriticWorker
    init_model = per_rank(CriticWorker.init_model)
    compute_values = gathered(CriticWorker.compute_values)
    update_critic = per_rank(CriticWorker.update_critic)
