"""`RewardModelWorker`: scores (prompt, response) pairs with a sequence-level reward model (scalar head).

The score is the head's output at the last valid response token, placed in the batch as `rm_scores` [B]; the
reward manager mixes it with rule rewards by weight (`reward.sources` entry `model`). The driver holds a
`RewardModelGroup`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hybridflow.config import Config
from hybridflow.controller import Dispatch, RoleGroup, Worker, gathered, per_rank, register
from hybridflow.engine import TrainEngine
from hybridflow.protocol import DataProto, keys
from hybridflow.workers.engine_specs import SCORES, reward_model_spec

if TYPE_CHECKING:
    from hybridflow.engine import TrainEngine


class RewardModelWorker(Worker):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.rm: TrainEngine  # built by init_model

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        if not self.cfg.reward.reward_model.path:
            raise ValueError("reward.reward_model.path is required when a reward source is `model`: "
                             "train one with `hybridflow rm` and point reward.reward_model.path at its export")
        self.init_distributed()
        torch.manual_seed(self.cfg.trainer.seed)  # the new scalar head is randomly initialised
        self.rm = TrainEngine(reward_model_spec(self.cfg), device=self.device)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @keys.checked_stage(keys.REWARD_MODEL_SCORE)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(tensors={keys.RM_SCORES: self.rm.infer(data, SCORES)["scores"]})


class RewardModelGroup(RoleGroup):
    """Driver-side handle of a `RewardModelWorker` group (or colocated role view)."""

    worker_cls = RewardModelWorker
    init_model = per_rank(RewardModelWorker.init_model)
    compute_rm_score = gathered(RewardModelWorker.compute_rm_score)
