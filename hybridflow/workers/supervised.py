"""`SupervisedWorker`: one TrainEngine trained on a fixed objective (SFT, reward model, DPO), driven like
every other role through a `WorkerGroup` — so local, multi-process and Ray runs behave the same as in PPO.

The engine is built from the `EngineSpec` the trainer derives from its `sft`/`rm` section
(`workers/engine_specs.py`); the loss is chosen by name from `SUPERVISED_LOSSES`, so nothing unpicklable crosses
to Ray. Checkpointing is the trained roles' (`CheckpointingWorker`, component `engine`). The driver holds a
`SupervisedGroup`. DPO adds a frozen reference engine (`ref_spec`), or with LoRA reads the trained engine with its
adapters disabled, and — when its validation prompts have a scorer — a rollout engine on the trained engine's own
parameters (`generates`), so validation generates exactly as PPO's actor does (`hybrid_generate.py`).
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hybridflow.checkpoint.worker import CheckpointingGroup, CheckpointingWorker
from hybridflow.config import Config
from hybridflow.controller import Dispatch, Worker, gathered, per_rank, register
from hybridflow.data.vision import batch_vision_inputs, vision_column
from hybridflow.engine import TrainEngine, train_update
from hybridflow.engine.checkpoint import full_model_state, write_hf
from hybridflow.engine.model_forward import HeadRequest
from hybridflow.engine.spec import EngineSpec
from hybridflow.models.loader import load_tokenizer
from hybridflow.protocol import DataProto, keys
from hybridflow.workers.engine_specs import supervised_plan
from hybridflow.workers.hybrid_generate import build_engine_rollout, generate_on
from hybridflow.workers.supervised_batch import last_response_values
from hybridflow.workers.supervised_losses import build_loss

if TYPE_CHECKING:
    from hybridflow.engine import TrainEngine
    from hybridflow.rollout import RolloutEngine

logger = logging.getLogger(__name__)


class SupervisedWorker(CheckpointingWorker, Worker):
    """`spec` is the trained engine (`head`: "lm" for SFT, "value" for a reward model); `train_head` is what the
    loss reads (log-probs or values). `ref_spec`: a frozen reference engine (DPO without LoRA). `generates`: a
    rollout engine on the trained engine's parameters (`rollout.*`) for `generate_sequences`."""

    def __init__(self, cfg: Config, spec: EngineSpec, train_head: HeadRequest, loss: str,
                 loss_kwargs: dict[str, Any] | None = None, ref_spec: EngineSpec | None = None,
                 generates: bool = False) -> None:
        super().__init__()
        if spec.optimizer is None:
            raise ValueError("a supervised engine is trained: its EngineSpec needs an optimizer")
        self.cfg, self.spec, self.train_head, self.ref_spec = cfg, spec, train_head, ref_spec
        self.generates = generates
        self.loss_fn = build_loss(loss, **(loss_kwargs or {}))
        self.engine: TrainEngine  # built by init_model
        self.ref: TrainEngine | None = None
        self.rollout: RolloutEngine | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.init_distributed()
        # A head missing from the checkpoint (RM from an SFT model) is drawn from the global RNG: seed it the same
        # on every rank so runs repeat and FSDP2 shards one model.
        torch.manual_seed(self.cfg.trainer.seed)
        self.engine = TrainEngine(self.spec, device=self.device)
        if self.ref_spec is not None:
            self.ref = TrainEngine(self.ref_spec, device=self.device)
        if self.generates:
            self.rollout, _ = build_engine_rollout(self.cfg, self.engine, load_tokenizer(self.cfg.model), self.device)

    # ------------------------------------------------------------------------------------------------ train
    @register(dispatch_mode=Dispatch.DP_COMPUTE_METRIC)
    def train_batch(self, data: DataProto) -> dict[str, float]:
        """One optimizer step on this rank's share of the batch (the engine micro-batches it)."""

        metrics = train_update(self.engine, data, self.loss_fn, self.train_head, supervised_plan(len(data)))
        return {k: float(v) for k, v in metrics.items()}

    # ------------------------------------------------------------------------------------------------- eval
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Responses of the trained model to `prompts` (sampling from meta_info, as the PPO actor's)."""
        if self.rollout is None:
            raise ValueError("this supervised worker has no rollout engine: build it with generates=True")
        return generate_on(self.engine, self.rollout, prompts)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def eval_lm(self, data: DataProto) -> DataProto:
        """Per-row sums for SFT validation: log-likelihood of the loss tokens, loss tokens, argmax hits."""
        # The engine moves micro-batches to its device and returns CPU tensors.
        logp_BR = self.engine.infer(data, self.train_head)["log_probs"]
        mask_BR = data.batch[keys.RESPONSE_MASK].to(logp_BR.dtype)
        hits_BR = self._argmax_hits(data).cpu()
        return DataProto.from_dict({
            "sum_logp": (logp_BR * mask_BR).sum(-1).float().cpu(),
            "num_tokens": mask_BR.sum(-1).float().cpu(),
            "num_correct": (hits_BR.to(mask_BR.dtype) * mask_BR).sum(-1).float().cpu(),
        })

    @torch.no_grad()
    def _argmax_hits(self, data: DataProto) -> torch.Tensor:
        """[B, R] bool: the model's greedy token equals the response token. A plain padded HF forward through
        the root module (FSDP2 hooks apply); logits only for the last R+1 positions, in micro-batches. With images,
        HF's forward runs the vision tower and derives the 3-D rope positions itself."""
        b = data.batch
        R = b[keys.RESPONSES].shape[1]
        micro = self.spec.infer_batching.size
        images = vision_column(data.non_tensor_batch)
        image_token = getattr(self.engine.module.config, "image_token_id", None)
        out = []
        for s in range(0, len(data), micro):
            sl = slice(s, s + micro)
            dev = {k: b[k][sl].to(self.engine.device) for k in (keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS)}
            vision = batch_vision_inputs(None if images is None else images[sl], b[keys.INPUT_IDS][sl], image_token)
            if vision:
                dev |= {k: v.to(self.engine.device) for k, v in vision.items()} | {keys.POSITION_IDS: None}
            logits = self.engine.module(**dev, use_cache=False, logits_to_keep=R + 1).logits
            out.append((logits[:, :R].argmax(-1) == b[keys.RESPONSES][sl].to(logits.device)).cpu())
        return torch.cat(out)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def eval_log_probs(self, data: DataProto) -> DataProto:
        """The trained model's response log-probs [B, R] (`log_probs`)."""
        return DataProto.from_dict({"log_probs": self.engine.infer(data, self.train_head)["log_probs"]})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """The reference's response log-probs [B, R] (`ref_log_prob`): the frozen reference engine, or with LoRA
        the trained engine with its adapters disabled (the base model)."""
        if self.ref is not None:
            out = self.ref.infer(data, self.train_head)
        elif self.spec.uses_lora:
            out = self.engine.infer(data, self.train_head, disable_adapters=True)
        else:
            raise ValueError("this supervised worker has no reference: build it with ref_spec (or LoRA adapters); "
                             "after dpo.precompute_ref the reference is freed and its log-probs come from the cache")
        return DataProto.from_dict({keys.REF_LOG_PROB: out["log_probs"]})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def release_ref(self) -> None:
        """Free the frozen reference engine (DPO with precomputed reference log-probs)."""
        self.ref = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def eval_scores(self, data: DataProto) -> DataProto:
        """Reward-model score of each pair row [B]: the value at its score slot (= the `score` head on the row
        without the slot, as in PPO)."""
        values_BR = self.engine.infer(data, self.train_head)[keys.VALUES]
        return DataProto.from_dict({"scores": last_response_values(values_BR, data.batch[keys.RESPONSE_MASK]).cpu()})

    # --------------------------------------------------------------------------------------------- save/load
    def checkpoint_engines(self) -> dict[str, TrainEngine]:
        return {"engine": self.engine}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_hf(self, out_dir: str) -> str:
        """Write the trained model as an HF directory (LoRA adapters merged into the in-memory base) with the one
        exporter, `hybridflow.engine.checkpoint.write_hf`; every rank takes part in each parameter's gather, only
        rank 0 keeps the copy and writes."""
        lora = self.engine.spec.lora if self.engine.lora_targets is not None else None
        self.engine.state_dict()  # brings offloaded parameters onto the device
        state = full_model_state(self.engine.module, None if lora is None else lora.alpha / lora.rank,
                                 keep=self.rank == 0)
        self.engine.to_rest()
        if self.rank == 0:
            write_hf(state, self.cfg.model, out_dir)
        return str(Path(out_dir))


class SupervisedGroup(CheckpointingGroup):
    """Driver-side handle of a `SupervisedWorker` group."""

    worker_cls = SupervisedWorker
    init_model = per_rank(SupervisedWorker.init_model)
    train_batch = per_rank(SupervisedWorker.train_batch)
    generate_sequences = gathered(SupervisedWorker.generate_sequences)
    eval_lm = gathered(SupervisedWorker.eval_lm)
    eval_log_probs = gathered(SupervisedWorker.eval_log_probs)
    compute_ref_log_prob = gathered(SupervisedWorker.compute_ref_log_prob)
    eval_scores = gathered(SupervisedWorker.eval_scores)
    release_ref = per_rank(SupervisedWorker.release_ref)
    export_hf = per_rank(SupervisedWorker.export_hf)
