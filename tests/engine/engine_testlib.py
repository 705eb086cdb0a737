"""Helpers for engine tests: tiny-model configs and engines, verl-layout batches, an SFT loss, one-update steps."""

from __future__ import annotations

import torch

from hybridflow.algorithms.aggregation import agg_loss
from hybridflow.checkpoint import CheckpointManager
from hybridflow.config import load_config
from hybridflow.engine import HeadRequest, TrainEngine, UpdatePlan, train_update
from hybridflow.protocol import DataProto
from hybridflow.workers.engine_specs import actor_spec, critic_spec


def make_config(*overrides: str):
    base = ["actor.optim.lr=1e-3", "actor.grad_clip=1e6", "actor.ppo_mini_batch_size=8",
            "actor.ppo_micro_batch_size_per_gpu=8", "actor.shuffle=false", "actor.optim.weight_decay=0.0"]
    return load_config(files=[], overrides=base + list(overrides))


def make_batch(batch: int = 8, prompt: int = 6, response: int = 5, seed: int = 0, vocab: int = 90) -> DataProto:
    """Random verl-layout batch: prompts left-padded to `prompt`, responses right-padded to `response`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, prompt + response), generator=g)
    mask = torch.ones(batch, prompt + response, dtype=torch.long)
    for b in range(batch):
        left = int(torch.randint(0, prompt - 1, (1,), generator=g))
        resp = int(torch.randint(1, response + 1, (1,), generator=g))
        mask[b, :left] = 0
        mask[b, prompt + resp:] = 0
    ids = ids * mask  # pad id 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(tensors=dict(input_ids=ids, attention_mask=mask, position_ids=pos,
                                            responses=ids[:, prompt:], response_mask=mask[:, prompt:]))


def nll_loss(outputs, micro_batch, global_norm):
    """Token-mean negative log-likelihood of the responses (the SFT loss), split-invariant."""
    loss = agg_loss(-outputs["log_probs"], micro_batch.batch["response_mask"], "token-mean",
                    global_norm["token-mean"])
    return loss, {"nll_share": loss.detach()}


def nan_loss(outputs, micro_batch, global_norm):
    """`nll_loss` times NaN: a step the engine must skip."""
    loss, metrics = nll_loss(outputs, micro_batch, global_norm)
    return loss * float("nan"), metrics


def make_engine(*overrides: str, role: str = "actor", total_training_steps: int | None = None) -> TrainEngine:
    """The actor's (or critic's) engine for `make_config(*overrides)`, on the CPU."""
    cfg = make_config(*overrides)
    spec = critic_spec(cfg, total_training_steps) if role == "critic" else actor_spec(cfg, total_training_steps)
    return TrainEngine(spec, device="cpu")


def save_engine(engine: TrainEngine, root) -> None:
    """Write `engine` the trainer's way (one `actor` component of a `CheckpointManager` checkpoint)."""
    with CheckpointManager(root, async_save=False, capture_rng=False) as mgr:
        mgr.save(engine.global_step, {"actor": engine.state_dict()})
    engine.to_rest()


def load_engine(engine: TrainEngine, root) -> None:
    """Load the latest checkpoint under `root` into `engine`, as a resuming worker does."""
    loaded = CheckpointManager(root, capture_rng=False).load(templates={"actor": engine.state_dict()})
    engine.load_state_dict(loaded.components["actor"])


def head_of(engine: TrainEngine, temperature: float = 1.0, entropy: bool = False) -> HeadRequest:
    """Log-probs for a language model, values for a scalar head."""
    return HeadRequest("lm", temperature, 1024, entropy) if engine.spec.head == "lm" else HeadRequest("value")


def train_step(engine: TrainEngine, data: DataProto, loss_fn, *, mini_batch_size: int | None = None,
               epochs: int = 1) -> dict[str, float]:
    """One update of `engine` on `data` (default: one mini-batch of all rows, in order)."""
    plan = UpdatePlan(mini_batch_size or len(data), epochs)
    return train_update(engine, data, loss_fn, head_of(engine), plan)


def logprobs(engine: TrainEngine, data: DataProto, temperature: float = 1.0, entropy: bool = False):
    return engine.infer(data, head_of(engine, temperature, entropy))
