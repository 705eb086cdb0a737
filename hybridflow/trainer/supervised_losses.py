"""Losses of the supervised trainers (SFT, reward model), as `TrainEngine.forward_backward` loss closures.

Decision: each loss is this micro-batch's share of the whole mini-batch loss — normalised by the engine's
`global_norm` (counts over every micro-batch on every data-parallel rank) — so the engine's summed gradients are
exactly the whole-batch mean however it split the batch. Metrics are micro-batch means (the engine averages
them). A new objective (e.g. DPO) is one more entry in `SUPERVISED_LOSSES`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from hybridflow.protocol import DataProto
from hybridflow.trainer.supervised_batch import last_response_values, pair_halves
from hybridflow.utils.registry import Registry

LossFn = Callable[[dict[str, torch.Tensor], DataProto, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, Any]]]

SUPERVISED_LOSSES: Registry = Registry("supervised loss")


@SUPERVISED_LOSSES.register("sft")
def make_sft_loss(**_: Any) -> LossFn:
    """Negative log-likelihood of the response (loss-mask) tokens, token-mean over the whole mini-batch."""

    def loss_fn(outputs: dict[str, torch.Tensor], mb: DataProto,
                global_norm: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        logp_BR = outputs["log_probs"]
        mask_BR = mb.batch["response_mask"].to(logp_BR.dtype)
        loss = -(logp_BR * mask_BR).sum() / global_norm["token-mean"].clamp(min=1)
        return loss, {}  # the engine reports `loss` (summed shares = the whole-batch NLL)

    return loss_fn


def bradley_terry(r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: float = 0.0) -> torch.Tensor:
    """Per-pair loss -log σ(r_c - r_r - margin)."""
    return -F.logsigmoid(r_chosen - r_rejected - margin)


@SUPERVISED_LOSSES.register("bradley_terry")
def make_bt_loss(margin: float = 0.0, **_: Any) -> LossFn:
    """Bradley-Terry reward-model loss on interleaved (chosen, rejected) rows with score slots (the score is the
    value at the slot = the scalar head at the last real token), pair-mean over the whole mini-batch."""

    def loss_fn(outputs: dict[str, torch.Tensor], mb: DataProto,
                global_norm: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        scores_B = last_response_values(outputs["values"], mb.batch["response_mask"])
        r_c, r_r = pair_halves(scores_B, mb.batch["pair_chosen"])
        # Every row has response tokens, so the sequence count over the mini-batch is 2 × its pairs.
        num_pairs = (global_norm["seq-mean-token-mean"] / 2).clamp(min=1)
        loss = bradley_terry(r_c, r_r, margin).sum() / num_pairs
        diff = (r_c - r_r).detach()
        return loss, {"rm/accuracy": (diff > 0).float().mean(), "rm/reward_margin": diff.mean(),
                      "rm/chosen_reward": r_c.detach().mean(), "rm/rejected_reward": r_r.detach().mean()}

    return loss_fn


def build_loss(name: str, **kwargs: Any) -> LossFn:
    return SUPERVISED_LOSSES[name](**kwargs)
