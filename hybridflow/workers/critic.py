"""`CriticWorker`: value model (actor backbone + scalar head) trained with the clipped value loss; the driver
holds a `CriticGroup`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hybridflow.checkpoint.worker import CheckpointingGroup, CheckpointingWorker
from hybridflow.config import Config, resolve
from hybridflow.controller import Dispatch, Worker, gathered, per_rank, register
from hybridflow.protocol import DataProto
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
        from hybridflow.engine import build_train_engine

        self.init_distributed()
        cfg = self.cfg
        torch.manual_seed(self.cfg.trainer.seed)  # the new scalar head is randomly initialised
        self.critic = build_train_engine(cfg.model, cfg.critic, role="critic", device=self.device, data_cfg=cfg.data,
                                         total_training_steps=total_training_steps, model_path=cfg.critic.model_path,
                                         seed=cfg.model.seed)
        self.loss_fn = make_critic_loss(self.cfg.critic, self.cfg.data.max_response_length)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_values(self, data: DataProto) -> DataProto:
        out = self.critic.forward_values(data)
        return DataProto.from_dict({"values": out.batch["values"]})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def update_critic(self, data: DataProto) -> dict[str, float]:
        mini = resolve(self.cfg).critic.mini_batch_samples_per_gpu
        metrics = self.critic.train_step(data, self.loss_fn, mini_batch_size=mini)
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
