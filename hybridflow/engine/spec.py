"""`EngineSpec`: everything a `TrainEngine` is built from — module, precision/sharding, micro-batching, optimizer.

Decision: the engine knows no roles. Each caller (actor, reference, critic, reward model, SFT, RM) maps its own
config section onto a spec in `hybridflow/workers/engine_specs.py`; the loss, the output head and the
mini-batch/epoch plan come with each call (`forward_backward(batch, loss_fn, head)`, `engine/update.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybridflow.config.schema import FSDPConfig, LoraConfig, ModelConfig, OptimConfig

ModuleHead = Literal["lm", "value"]  # causal LM (log-probs of tokens) | backbone + scalar head (values, scores)
MODULE_HEADS: tuple[ModuleHead, ...] = ("lm", "value")


@dataclass(frozen=True)
class MicroBatching:
    """How one forward(/backward) pass cuts its batch: `size` SAMPLES per micro-batch, or — when `dynamic` —
    balanced micro-batches of at most `max_tokens` TOKENS each (same count on every rank)."""

    size: int
    dynamic: bool = False
    max_tokens: int = 0


@dataclass(frozen=True)
class OptimizerSpec:
    """Optimizer + LR schedule of a trained module; `total_steps` = schedule length in updates (None = constant
    after warm-up, see `engine/optim.py`)."""

    optim: OptimConfig
    grad_clip: float
    total_steps: int | None = None


@dataclass(frozen=True)
class EngineSpec:
    """One FSDP2 module. `optimizer=None` builds a frozen, inference-only engine. `model_path=None` loads
    `model.path` (or `model.preset`). `fsdp` holds precision (param/reduce dtypes), sharding and offload."""

    model: ModelConfig
    head: ModuleHead
    fsdp: FSDPConfig
    infer_batching: MicroBatching
    train_batching: MicroBatching | None = None  # required when `optimizer` is given
    optimizer: OptimizerSpec | None = None
    model_path: str | None = None
    packed: bool = True  # data.use_packed_dataset: forward passes without padding
    lora: LoraConfig | None = None  # adapters on a trained module (rank 0 or None = full fine-tuning)
    routing_replay: bool = False  # MoE: forwards use the batch's `routed_experts` (engine/moe_replay.py)
    moe_aux_loss_coef: float = 0.0  # MoE: + coef x the routers' load-balancing loss in training (engine/moe_aux.py)
    exact_logprobs: bool = False  # batch-invariant forward ops (engine/invariant.py), as the rollout engine's

    def __post_init__(self) -> None:
        if self.head not in MODULE_HEADS:
            raise ValueError(f"head={self.head!r}: must be one of {', '.join(MODULE_HEADS)}")
        if self.optimizer is not None and self.train_batching is None:
            raise ValueError("a trained engine (optimizer given) needs train_batching")
        if self.moe_aux_loss_coef < 0:
            raise ValueError(f"moe_aux_loss_coef={self.moe_aux_loss_coef}: must be >= 0 (0 = off)")
        if self.uses_lora and self.optimizer is None:
            raise ValueError("LoRA adapters need a trained engine (EngineSpec.optimizer); a frozen engine has none")

    @property
    def uses_lora(self) -> bool:
        return self.lora is not None and self.lora.enabled

    @property
    def trainable(self) -> bool:
        return self.optimizer is not None
