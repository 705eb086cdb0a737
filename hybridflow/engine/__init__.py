"""FSDP2 training engine: wrapping, mixed precision, optimizer + LR schedule, packing, chunked log-probs, offload."""

from __future__ import annotations

import torch

from hybridflow.config.schema import DataConfig, ModelConfig
from hybridflow.engine.settings import RoleConfig
from hybridflow.engine.train_engine import TrainEngine

__all__ = ["TrainEngine", "build_train_engine"]


def build_train_engine(model_cfg: ModelConfig, role_cfg: RoleConfig, *, role: str,
                       device: str | torch.device | None = None, data_cfg: DataConfig | None = None,
                       total_training_steps: int | None = None, model_path: str | None = None,
                       seed: int = 0) -> TrainEngine:
    """The engine for `role` (actor | critic | ref | reward); see `TrainEngine`."""
    return TrainEngine(model_cfg, role_cfg, role=role, device=device, data_cfg=data_cfg,
                       total_training_steps=total_training_steps, model_path=model_path, seed=seed)
