"""Offline preference losses on per-pair sequence log-probs: `dpo` (sigmoid; label smoothing = cDPO), `ipo`,
`simpo` (reference-free, length-normalised, target margin `gamma`), selected by name (`dpo.loss_type`).

Decision: the formulas take summed log-probs of each whole response (and the response lengths), never tokens, so
they are written once, tested against the papers' formulas, and shared by training (engine closure) and validation.
IPO follows its paper (summed log-probs, target 1/(2β)); TRL's IPO averages log-probs per token instead.
Legend: P pairs; `*_P` tensors hold one value per (chosen, rejected) pair.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PREFERENCE_LOSSES = ("dpo", "ipo", "simpo")
REFERENCE_FREE = ("simpo",)


@dataclass(frozen=True)
class PairLogps:
    """Summed response log-probs of the policy (and the reference) per pair, and response lengths in tokens."""

    chosen_P: torch.Tensor
    rejected_P: torch.Tensor
    ref_chosen_P: torch.Tensor | None = None
    ref_rejected_P: torch.Tensor | None = None
    chosen_len_P: torch.Tensor | None = None
    rejected_len_P: torch.Tensor | None = None


@dataclass(frozen=True)
class PreferenceLoss:
    """Per-pair loss and the implicit rewards (detached) that the metrics report."""

    loss_P: torch.Tensor
    chosen_reward_P: torch.Tensor
    rejected_reward_P: torch.Tensor


def _ref_delta(x: PairLogps) -> tuple[torch.Tensor, torch.Tensor]:
    if x.ref_chosen_P is None or x.ref_rejected_P is None:
        raise ValueError("dpo/ipo need reference log-probs (a frozen reference, or LoRA with adapters disabled); "
                         "only dpo.loss_type=simpo is reference-free")
    return x.chosen_P - x.ref_chosen_P, x.rejected_P - x.ref_rejected_P


def dpo(x: PairLogps, beta: float, label_smoothing: float = 0.0) -> PreferenceLoss:
    """DPO (Rafailov et al. 2023): -log σ(β[(π_c - ref_c) - (π_r - ref_r)]); with ε = label_smoothing the
    conservative cDPO target: -(1-ε) log σ(z) - ε log σ(-z)."""
    d_c, d_r = _ref_delta(x)
    z = beta * (d_c - d_r)
    loss = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return PreferenceLoss(loss, (beta * d_c).detach(), (beta * d_r).detach())


def ipo(x: PairLogps, beta: float) -> PreferenceLoss:
    """IPO (Azar et al. 2023, eq. 17 with τ = beta): ((π_c - ref_c) - (π_r - ref_r) - 1/(2τ))²."""
    d_c, d_r = _ref_delta(x)
    loss = (d_c - d_r - 1.0 / (2.0 * beta)) ** 2
    return PreferenceLoss(loss, (beta * d_c).detach(), (beta * d_r).detach())


def simpo(x: PairLogps, beta: float, gamma: float, label_smoothing: float = 0.0) -> PreferenceLoss:
    """SimPO (Meng et al. 2024): reward r = β/|y| · log π(y|x); loss -log σ(r_c - r_r - γ) (label smoothing as
    in the authors' code)."""
    if x.chosen_len_P is None or x.rejected_len_P is None:
        raise ValueError("simpo needs the response lengths (chosen_len_P, rejected_len_P)")
    r_c = beta * x.chosen_P / x.chosen_len_P.clamp(min=1)
    r_r = beta * x.rejected_P / x.rejected_len_P.clamp(min=1)
    z = r_c - r_r - gamma
    loss = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    return PreferenceLoss(loss, r_c.detach(), r_r.detach())


def preference_loss(x: PairLogps, loss_type: str, beta: float, label_smoothing: float = 0.0,
                    gamma: float = 0.0) -> PreferenceLoss:
    """The `loss_type` loss (one of PREFERENCE_LOSSES) per pair."""
    if loss_type == "dpo":
        return dpo(x, beta, label_smoothing)
    if loss_type == "ipo":
        return ipo(x, beta)
    if loss_type == "simpo":
        return simpo(x, beta, gamma, label_smoothing)
    raise ValueError(f"dpo.loss_type={loss_type!r}: choose one of {', '.join(PREFERENCE_LOSSES)}")
