"""`RolloutWorker`: the separate generation worker of the non-sync modes (`trainer.mode=one_step_off|async`).

It holds its own copy of the policy (a plain HF module in the actor's master dtype, no FSDP, no optimizer) and its
own `RolloutEngine` (KV cache, CUDA graphs), in its own resource pool (`resource_pool.rollout_process_on_nodes`).
The trainer sends new weights after each actor update (`receive_weights`, `workers/weight_sync.py`); every
generated row carries the `policy_version` (optimizer steps) of the weights that produced it.

Calls are non-blocking (the driver overlaps them with training) and run in submission order on each rank (Ray runs
one call at a time per actor, first in first out): weights sent after a generate request are used from the next
request on, never in the middle of one.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from hybridflow.config import Config
from hybridflow.controller import Dispatch, RoleGroup, Worker, future, per_rank, register
from hybridflow.protocol import DataProto, keys
from hybridflow.workers.actor_rollout_ref import _seeds_to_meta
from hybridflow.workers.weight_sync import WeightBucket, full_parameters, load_buckets

if TYPE_CHECKING:
    from torch import nn

    from hybridflow.rollout import RolloutEngine


class RolloutWorker(Worker):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.version = 0  # optimizer steps of the weights held
        self.module: nn.Module
        self.rollout: RolloutEngine
        self._idle_since: float | None = None  # end of the previous call (the time since is `timing/wait_train`)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from hybridflow.engine.fsdp import DTYPES
        from hybridflow.models.loader import load_module, load_tokenizer
        from hybridflow.rollout import build_rollout

        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.model)
        # the actor's master dtype: the rollout engine casts (bf16 on GPU) exactly as the hybrid engine does
        dtype = DTYPES[cfg.actor.fsdp.param_dtype]
        module = load_module(cfg.model, "lm", dtype=dtype, init_device=self.device)
        self.module = module.to(self.device).eval().requires_grad_(False)
        self.rollout = build_rollout(
            self.module, cfg.rollout, eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id, max_prompt_length=cfg.data.max_prompt_length,
            max_response_length=cfg.data.max_response_length, device=self.device, tokenizer=self.tokenizer,
        )
        self._idle_since = time.perf_counter()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    @keys.checked_stage(keys.GEN)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generate with the weights of `self.version`; each row records that version."""
        t0 = time.perf_counter()
        out = self.rollout.generate(_seeds_to_meta(prompts)).to("cpu")
        t1 = time.perf_counter()
        out.meta_info.pop("seeds", None)
        out.batch[keys.POLICY_VERSION.name] = torch.full((len(out),), self.version, dtype=torch.long)
        engine_metrics = out.meta_info.get("metrics") or {}
        out.meta_info["metrics"] = {**engine_metrics, "timing/generate": t1 - t0,
                                    "timing/wait_train": self._idle(t0)}
        self._idle_since = t1
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def receive_weights(self, buckets: list[WeightBucket], version: int) -> dict[str, float]:
        """Copy the trainer's weights (bit-exact) and make the next generate use them."""
        t0 = time.perf_counter()
        nbytes = load_buckets(self.module, buckets)
        self.rollout.sync_weights()
        self.version = int(version)
        t1 = time.perf_counter()
        idle = self._idle(t0)
        self._idle_since = t1
        return {"weight_sync/rollout_load_s": t1 - t0, "weight_sync/bytes": float(nbytes),
                "weight_sync/buckets": float(len(buckets)), "weight_sync/version": float(version),
                "timing/wait_train_sync": idle}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights(self) -> dict[str, torch.Tensor]:
        """The rollout's parameters (CPU copies) and nothing else: for checks (bit-exactness tests)."""
        return dict(full_parameters(self.module))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def policy_version(self) -> int:
        return self.version

    def _idle(self, now: float) -> float:
        return 0.0 if self._idle_since is None else max(0.0, now - self._idle_since)


class RolloutGroup(RoleGroup):
    """Driver-side handle of the `RolloutWorker` group."""

    worker_cls = RolloutWorker
    init_model = per_rank(RolloutWorker.init_model)
    generate_sequences = future(RolloutWorker.generate_sequences)
    receive_weights = future(RolloutWorker.receive_weights)
    weights = per_rank(RolloutWorker.weights)
    policy_version = per_rank(RolloutWorker.policy_version)
