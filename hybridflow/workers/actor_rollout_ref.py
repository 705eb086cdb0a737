"""`ActorRolloutRefWorker`: one process per GPU holding the actor (FSDP2 TrainEngine), the rollout engine that
generates on the actor's own parameters (hybrid engine), and the reference policy (frozen copy or EMA).

Each `@register`-ed method is one driver call; data arrives already split by data-parallel rank. The driver holds
an `ActorRolloutRefGroup`, whose attributes are these methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hybridflow.checkpoint.worker import CheckpointingGroup, CheckpointingWorker
from hybridflow.config import Config, resolve
from hybridflow.controller import Dispatch, Worker, gathered, per_rank, register
from hybridflow.engine import TrainEngine, moe_replay, train_update
from hybridflow.engine.lora import merged_state_dict
from hybridflow.engine.update import UpdatePlan
from hybridflow.models.loader import load_tokenizer
from hybridflow.protocol import DataProto, keys
from hybridflow.workers.engine_specs import (
    actor_head,
    actor_plan,
    actor_spec,
    ref_head,
    ref_spec,
    teacher_spec,
)
from hybridflow.workers.hybrid_generate import TPGeneration, build_engine_rollout, generate_on, tp_group
from hybridflow.workers.losses import make_actor_loss
from hybridflow.workers.supervised_losses import build_loss
from hybridflow.workers.weight_collective import BroadcastStats, CollectiveWeights, WeightSender
from hybridflow.workers.weight_sync import WeightBucket, full_parameters, pack_buckets

if TYPE_CHECKING:
    from hybridflow.engine import TrainEngine
    from hybridflow.rollout import RolloutEngine


class ActorRolloutRefWorker(CheckpointingWorker, Worker):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg, self.res = cfg, resolve(cfg)
        self.actor: TrainEngine  # built by init_model
        self.rollout: RolloutEngine
        self.tp: TPGeneration | None = None  # rollout.tensor_model_parallel_size > 1
        self.ref: TrainEngine | None = None  # only when a reference policy is used
        self.teacher: TrainEngine | None = None  # only for on-policy distillation (algorithm.adv_estimator=distill)
        self._weight_sender: WeightSender | None = None  # rank 0, weight_sync.transport=collective

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, total_training_steps: int | None = None) -> None:
        self.init_distributed()
        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.model)
        self.actor = TrainEngine(actor_spec(cfg, total_training_steps), device=self.device)
        # same weights as the actor at step 0 (same path, or same preset seed); with LoRA no second model: the
        # reference is the actor with its adapters disabled
        if self.res.use_reference and not cfg.model.lora.enabled:
            self.ref = TrainEngine(ref_spec(cfg), device=self.device)
        if self.res.use_teacher:
            self.teacher = TrainEngine(teacher_spec(cfg), device=self.device)
            check_teacher_vocab(self.teacher.module, len(self.tokenizer), cfg.teacher.model_path)
        group = tp_group(self.rank, self.world_size, cfg.rollout.tensor_model_parallel_size)
        self.rollout, self.tp = build_engine_rollout(cfg, self.actor, self.tokenizer, self.device, group)
        self.loss_fn = make_actor_loss(cfg.actor, cfg.data.max_response_length, cfg.actor.use_kl_loss,
                                       rollout_is=self.res.rollout_is)

    # ------------------------------------------------------------------------------------------- generate
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @keys.checked_stage(keys.GEN)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Train → generate → train on the same weights (`hybrid_generate.generate_on`)."""
        return generate_on(self.actor, self.rollout, prompts, self.tp)

    # ------------------------------------------------------------------------------------------ log-probs
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @keys.checked_stage(keys.OLD_LOG_PROB)
    def compute_log_prob(self, data: DataProto, beside: Callable[[], object] | None = None) -> DataProto:
        """`beside`: host work of the driver, run once the forwards are queued (in-process workers only)."""
        out = self.actor.infer(data, actor_head(self.cfg, entropy=True), beside=beside)
        moe = moe_replay.metrics(out, data.batch)  # MoE: routing agreement with the rollout, log-prob gap
        return DataProto.from_dict({keys.OLD_LOG_PROBS: out["log_probs"], keys.ENTROPY: out[keys.ENTROPY]},
                                   meta_info={"metrics": moe} if moe else None)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @keys.checked_stage(keys.REF)
    def compute_ref_log_prob(self, data: DataProto, beside: Callable[[], object] | None = None) -> DataProto:
        if self.cfg.model.lora.enabled:
            out = self.actor.infer(data, ref_head(self.cfg), disable_adapters=True, beside=beside)
        else:
            assert self.ref is not None, "compute_ref_log_prob needs a reference policy (res.use_reference)"
            out = self.ref.infer(data, ref_head(self.cfg), beside=beside)
        return DataProto.from_dict({keys.REF_LOG_PROB: out["log_probs"]})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @keys.checked_stage(keys.TEACHER)
    def compute_teacher_log_prob(self, data: DataProto, beside: Callable[[], object] | None = None) -> DataProto:
        """On-policy distillation: the frozen teacher's log-probs of the student's sampled tokens, at the sampling
        temperature (as the reference's)."""
        assert self.teacher is not None, "compute_teacher_log_prob needs a teacher (algorithm.adv_estimator=distill)"
        out = self.teacher.infer(data, ref_head(self.cfg), beside=beside)
        return DataProto.from_dict({keys.TEACHER_LOG_PROBS.name: out["log_probs"]})

    # ------------------------------------------------------------------------------------------- update
    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    @keys.checked_stage(keys.UPDATE_ACTOR)
    def update_actor(self, data: DataProto, late: Callable[[], DataProto] | None = None) -> dict[str, float]:
        """`late` (in-process workers only): returns `data` with the loss columns it lacks (the advantages), called
        once the first forward is queued (`engine/update.py`)."""

        metrics = train_update(self.actor, data, self.loss_fn, actor_head(self.cfg, entropy=True),
                               actor_plan(self.cfg, self.res.actor), late=late)
        metrics = {(k if "/" in k else f"actor/{k}"): v for k, v in metrics.items()}
        if torch.cuda.is_available():
            metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
            metrics["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
        return metrics

    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def update_actor_preference(self, data: DataProto) -> dict[str, float]:
        """Online DPO: one optimizer step of the `dpo.loss_type` loss on interleaved (chosen, rejected) rows and
        their `ref_log_prob` (none for SimPO); log-probs at the sampling temperature, like the reference's."""

        d = self.cfg.dpo
        loss_fn = build_loss("preference", loss_type=d.loss_type, beta=d.beta, label_smoothing=d.label_smoothing,
                             gamma=d.gamma)
        metrics = train_update(self.actor, data, loss_fn, actor_head(self.cfg, entropy=False), UpdatePlan(len(data)))
        return {(k if "/" in k else f"actor/{k}"): v for k, v in metrics.items()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def update_ref_ema(self) -> None:
        """ref ← decay·ref + (1 − decay)·actor, shard by shard (both engines are wrapped identically)."""
        assert self.ref is not None, "update_ref_ema needs the EMA reference (ref.ema.enable)"
        decay = self.cfg.ref.ema.decay
        ref_params = dict(self.ref.module.named_parameters())
        with torch.no_grad():
            for name, p_act in self.actor.module.named_parameters():
                p_ref = _local(ref_params[name])
                p_ref.lerp_(_local(p_act).to(device=p_ref.device, dtype=p_ref.dtype), 1.0 - decay)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weight_buckets(self, bucket_bytes: int) -> list[WeightBucket]:
        """The actor's full parameters packed for the rollout workers of the non-sync modes (every rank takes part
        in the FSDP2 gather; rank 0 returns the buckets, the others an empty list). With LoRA: the merged weights
        W + (alpha/rank)·B·A under the plain model's names (the rollout worker holds no adapters)."""
        named = full_parameters(self.actor.module)
        if self.rank != 0:
            for _ in named:  # the gather is collective: every rank walks the parameters
                pass
            return []
        if self.actor.lora_targets is not None:
            lora = self.cfg.model.lora
            named = iter(merged_state_dict(dict(named), lora.alpha / lora.rank).items())
        return pack_buckets(named, bucket_bytes)

    # weight_sync.transport=collective: rank 0 broadcasts the buckets itself (workers/weight_collective.py)
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def open_weight_sender(self, n_receivers: int, timeout_s: float) -> tuple[str, int] | None:
        """Rank 0: host the weight group's store and start its sender thread; returns the store's (host, port)
        for the rollout workers' `join_weight_group` (the other ranks: None)."""
        if self.rank != 0:
            return None
        if self._weight_sender is not None:
            raise RuntimeError("open_weight_sender: this actor already has a weight group (it is built once)")
        self._weight_sender = WeightSender(self.worker_env.master_addr, n_receivers, self.device, timeout_s)
        return self._weight_sender.address

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stage_weights(self, bucket_bytes: int) -> tuple[CollectiveWeights, list[BroadcastStats]] | None:
        """`weight_buckets`, but rank 0 queues the buckets on its sender (broadcast in the background) and returns
        their control message and the broadcasts finished since the last call; raises a failed broadcast's error."""
        buckets = self.weight_buckets(bucket_bytes)
        if self.rank != 0:
            return None
        sender = self._weight_sender
        if sender is None:
            raise RuntimeError("stage_weights: no weight group; call open_weight_sender first")
        msg = sender.put(buckets)
        return msg, sender.finished()

    # ------------------------------------------------------------------------------------------ checkpoint
    def checkpoint_engines(self) -> dict[str, TrainEngine]:
        """The actor, and the reference only when it is an EMA (a frozen ref is rebuilt from the model)."""
        engines = {"actor": self.actor}
        if self.ref is not None and self.cfg.ref.ema.enable:
            engines["ref"] = self.ref
        return engines

    def checkpoint_rank_state(self) -> dict[str, Any]:
        # Default rollout seeds derive from the engine's call counter; restoring it keeps resumed sampling exact.
        return {"rollout": self.rollout.state_dict()}

    def load_checkpoint_rank_state(self, state: dict[str, Any]) -> None:
        if "rollout" in state:
            self.rollout.load_state_dict(state["rollout"])


class ActorRolloutRefGroup(CheckpointingGroup):
    """Driver-side handle of an `ActorRolloutRefWorker` group (or colocated role view); each attribute is the
    worker method of that name, run on every rank."""

    worker_cls = ActorRolloutRefWorker
    init_model = per_rank(ActorRolloutRefWorker.init_model)
    generate_sequences = gathered(ActorRolloutRefWorker.generate_sequences)
    compute_log_prob = gathered(ActorRolloutRefWorker.compute_log_prob)
    compute_ref_log_prob = gathered(ActorRolloutRefWorker.compute_ref_log_prob)
    compute_teacher_log_prob = gathered(ActorRolloutRefWorker.compute_teacher_log_prob)
    update_actor = per_rank(ActorRolloutRefWorker.update_actor)
    update_actor_preference = per_rank(ActorRolloutRefWorker.update_actor_preference)
    update_ref_ema = per_rank(ActorRolloutRefWorker.update_ref_ema)
    weight_buckets = per_rank(ActorRolloutRefWorker.weight_buckets)
    open_weight_sender = per_rank(ActorRolloutRefWorker.open_weight_sender)
    stage_weights = per_rank(ActorRolloutRefWorker.stage_weights)


def check_teacher_vocab(teacher: torch.nn.Module, tokenizer_size: int, path: str | None) -> None:
    """The teacher scores the student's token ids, so its vocabulary must cover the student's tokenizer."""
    vocab = teacher.config.vocab_size
    if vocab < tokenizer_size:
        raise ValueError(f"teacher.model_path={path!r} has a vocabulary of {vocab} tokens but the student's tokenizer "
                         f"has {tokenizer_size}: the teacher must use the student's tokenizer (same family); pick a "
                         "teacher of the student's family")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor parameter (the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t
