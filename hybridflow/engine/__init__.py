"""FSDP2 training engine: wrapping, mixed precision, optimizer + LR schedule, packing, chunked log-probs, offload.

Built from an `EngineSpec` (no roles here); `train_update` runs one update (epochs × mini-batches).
"""

from __future__ import annotations

from hybridflow.engine.model_forward import HeadRequest
from hybridflow.engine.spec import EngineSpec, MicroBatching, OptimizerSpec
from hybridflow.engine.train_engine import BackwardStats, LossFn, TrainEngine
from hybridflow.engine.update import UpdatePlan, train_update

__all__ = ["BackwardStats", "EngineSpec", "HeadRequest", "LossFn", "MicroBatching", "OptimizerSpec", "TrainEngine",
           "UpdatePlan", "train_update"]
