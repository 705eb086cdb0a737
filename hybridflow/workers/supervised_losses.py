"""Losses of the supervised trainers (SFT, reward model, DPO/IPO/SimPO), each an `engine.LossFn`.

Decision: each loss is this micro-batch's share of the whole mini-batch loss — normalised by the engine's
`global_norm` (counts over every micro-batch on every data-parallel rank) — so the engine's summed gradients are
exactly the whole-batch mean however it split the batch. Metrics are micro-batch means (the engine averages
them). A new objective is one more entry in `SUPERVISED_LOSSES` (name → the loss class, built with the
trainer's `loss_kwargs`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from hybridflow.algorithms.preference import REFERENCE_FREE, PairLogps, PreferenceLoss, preference_loss
from hybridflow.protocol import DataProto, keys
from hybridflow.utils.registry import Registry
from hybridflow.workers.supervised_batch import last_response_values, pair_halves

if TYPE_CHECKING:  # the engine's import is heavy (FSDP, transformers); the driver imports these losses by name
    from hybridflow.engine import LossFn

Metrics = dict[str, torch.Tensor | float]
SUPERVISED_LOSSES: Registry[Callable[..., LossFn]] = Registry("supervised loss")


@SUPERVISED_LOSSES.register("sft")
@dataclass(frozen=True)
class SFTLoss:
    """Negative log-likelihood of the response (loss-mask) tokens, token-mean over the whole mini-batch."""

    def __call__(self, outputs: dict[str, torch.Tensor], mb: DataProto,
                 global_norm: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Metrics]:
        logp_BR = outputs["log_probs"]
        mask_BR = mb.batch[keys.RESPONSE_MASK].to(logp_BR.dtype)
        loss = -(logp_BR * mask_BR).sum() / global_norm["token-mean"].clamp(min=1)
        return loss, {}  # the engine reports `loss` (summed shares = the whole-batch NLL)


def bradley_terry(r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: float = 0.0) -> torch.Tensor:
    """Per-pair loss -log σ(r_c - r_r - margin)."""
    return -F.logsigmoid(r_chosen - r_rejected - margin)


@SUPERVISED_LOSSES.register("bradley_terry")
@dataclass(frozen=True)
class BradleyTerryLoss:
    """Bradley-Terry reward-model loss on interleaved (chosen, rejected) rows with score slots (the score is the
    value at the slot = the scalar head at the last real token), pair-mean over the whole mini-batch."""

    margin: float = 0.0

    def __call__(self, outputs: dict[str, torch.Tensor], mb: DataProto,
                 global_norm: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Metrics]:
        scores_B = last_response_values(outputs[keys.VALUES], mb.batch[keys.RESPONSE_MASK])
        r_c, r_r = pair_halves(scores_B, mb.batch["pair_chosen"])
        # Every row has response tokens, so the sequence count over the mini-batch is 2 × its pairs.
        num_pairs = (global_norm["seq-mean-token-mean"] / 2).clamp(min=1)
        loss = bradley_terry(r_c, r_r, self.margin).sum() / num_pairs
        diff = (r_c - r_r).detach()
        return loss, {"rm/accuracy": (diff > 0).float().mean(), "rm/reward_margin": diff.mean(),
                      "rm/chosen_reward": r_c.detach().mean(), "rm/rejected_reward": r_r.detach().mean()}


def sequence_logps(logp_BR: torch.Tensor, mask_BR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob, token count) of each row's response [B]."""
    mask = mask_BR.to(logp_BR.dtype)
    return (logp_BR * mask).sum(-1), mask.sum(-1)


def pair_logps(logp_BR: torch.Tensor, mask_BR: torch.Tensor, pair_chosen_B: torch.Tensor,
               ref_logp_BR: torch.Tensor | None) -> PairLogps:
    """Interleaved pair rows → `PairLogps` (policy, reference when given, lengths)."""
    seq_B, len_B = sequence_logps(logp_BR, mask_BR)
    c, r = pair_halves(seq_B, pair_chosen_B)
    c_len, r_len = pair_halves(len_B, pair_chosen_B)
    ref_c = ref_r = None
    if ref_logp_BR is not None:
        ref_c, ref_r = pair_halves(sequence_logps(ref_logp_BR.to(logp_BR.dtype), mask_BR)[0], pair_chosen_B)
    return PairLogps(c, r, ref_c, ref_r, c_len, r_len)


def preference_metrics(x: PairLogps, out: PreferenceLoss) -> dict[str, torch.Tensor]:
    """TRL's names: implicit rewards, their margin and accuracy (chosen reward > rejected), summed log-probs."""
    margin = out.chosen_reward_P - out.rejected_reward_P
    return {"rewards/chosen": out.chosen_reward_P.mean(), "rewards/rejected": out.rejected_reward_P.mean(),
            "rewards/margins": margin.mean(), "rewards/accuracies": (margin > 0).float().mean(),
            "logps/chosen": x.chosen_P.detach().mean(), "logps/rejected": x.rejected_P.detach().mean()}


@SUPERVISED_LOSSES.register("preference")
@dataclass(frozen=True)
class PairPreferenceLoss:
    """DPO / IPO / SimPO (`algorithms.preference`) on interleaved (chosen, rejected) rows: each row's response
    log-probs are summed over `response_mask`; the reference's come with the batch as `ref_log_prob` (absent for
    the reference-free SimPO). Pair-mean over the whole mini-batch."""

    loss_type: str = "dpo"
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.0

    def __call__(self, outputs: dict[str, torch.Tensor], mb: DataProto,
                 global_norm: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Metrics]:
        ref = mb.batch[keys.REF_LOG_PROB] if self.loss_type not in REFERENCE_FREE else None
        x = pair_logps(outputs["log_probs"], mb.batch[keys.RESPONSE_MASK], mb.batch["pair_chosen"], ref)
        out = preference_loss(x, self.loss_type, self.beta, self.label_smoothing, self.gamma)
        num_pairs = (global_norm["seq-mean-token-mean"] / 2).clamp(min=1)  # every row has response tokens
        return out.loss_P.sum() / num_pairs, preference_metrics(x, out)


def build_loss(name: str, **kwargs: Any) -> LossFn:
    """The registered loss `name` built with the trainer's `loss_kwargs`."""
    return SUPERVISED_LOSSES[name](**kwargs)
