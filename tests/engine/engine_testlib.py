"""Helpers for engine tests: tiny-model configs, verl-layout batches, an SFT loss."""

from __future__ import annotations

import torch

from hybridflow.algorithms.aggregation import agg_loss
from hybridflow.config import load_config
from hybridflow.protocol import DataProto


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
