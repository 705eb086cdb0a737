"""Policy-gradient losses, registered by name in `POLICY_LOSSES`.

Every loss has one signature: `fn(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio_low,
clip_ratio_high, clip_ratio_c, loss_agg_mode, global_normalizer, max_len, rollout_is_weights, **_) -> (loss,
metrics)`; metrics are detached 0-d tensors (no host sync) `pg_clipfrac`, `pg_clipfrac_lower`, `ppo_kl`, computed
over this micro-batch's valid tokens. `rollout_is_weights` (B, T, detached; None = off) scales each token's loss
before aggregation: the rollout/training mismatch correction of rollout_is.py (a registered loss without that
parameter is refused when `algorithm.rollout_is.mode` is set). The aggregation and its global normaliser are
`agg_loss`'s (see aggregation.py). Legend: B batch, T response length.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Protocol

import torch
from torch import Tensor

from hybridflow.algorithms.aggregation import agg_loss
from hybridflow.algorithms.masked import masked_mean
from hybridflow.utils.registry import Registry

logger = logging.getLogger(__name__)

# exp() of a log-ratio beyond this is clamped: a numerical guard, never reached by a sane policy update.
_LOG_RATIO_CLAMP = 20.0


class PolicyLoss(Protocol):
    def __call__(
        self, old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, **kwargs: Any
    ) -> tuple[Tensor, dict[str, Tensor]]:
        ...


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def _check_clip(clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float | None) -> None:
    if not 0 <= clip_ratio_low < 1:
        raise ValueError(f"actor.clip_ratio_low={clip_ratio_low} must be in [0, 1) (ratio lower bound 1 - low)")
    if clip_ratio_high < 0:
        raise ValueError(f"actor.clip_ratio_high={clip_ratio_high} must be >= 0")
    if clip_ratio_c is not None and clip_ratio_c <= 1:
        raise ValueError(f"actor.clip_ratio_c={clip_ratio_c} must be > 1 (dual-clip bound), or null to disable it")


def _aggregate(pg_losses: Tensor, mask: Tensor, rollout_is_weights: Tensor | None, loss_agg_mode: str,
               global_normalizer: Tensor | float | None, max_len: int | None) -> Tensor:
    """Every loss's last step: the off-policy correction's detached per-token weights (rollout_is.py), then
    `agg_loss` with the mini-batch's global normaliser."""
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(pg_losses, mask, loss_agg_mode, global_normalizer=global_normalizer, max_len=max_len)


@POLICY_LOSSES.register("vanilla", "ppo")
def vanilla_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    global_normalizer: Tensor | float | None = None,
    max_len: int | None = None,
    rollout_is_weights: Tensor | None = None,
    **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clip with asymmetric bounds [1 - low, 1 + high] (clip-higher, DAPO) and dual-clip.

    Dual-clip (Ye et al. 2020) applies to negative advantages only: the token loss is capped at -A·c, so a
    huge ratio on a bad action cannot dominate. `clip_ratio_c=None` disables it.
    """
    _check_clip(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    m = response_mask
    neg_kl = torch.clamp(log_prob - old_log_prob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(neg_kl)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    metrics = {
        "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), m).detach(),
        "ppo_kl": masked_mean(-neg_kl, m).detach(),
    }
    if clip_ratio_c is not None:
        loss_cap = -advantages * clip_ratio_c
        dual = (advantages < 0) & (loss_ppo > loss_cap)
        pg_losses = torch.where(advantages < 0, torch.minimum(loss_ppo, loss_cap), loss_ppo)
        metrics["pg_clipfrac_lower"] = masked_mean(dual.float(), m).detach()
    else:
        pg_losses = loss_ppo
        metrics["pg_clipfrac_lower"] = torch.zeros((), device=ratio.device)
    return _aggregate(pg_losses, m, rollout_is_weights, loss_agg_mode, global_normalizer, max_len), metrics


@POLICY_LOSSES.register("gspo")
def gspo_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    global_normalizer: Tensor | float | None = None,
    max_len: int | None = None,
    rollout_is_weights: Tensor | None = None,
    **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, s = exp(mean_t(log π - log π_old)).

    Written token-wise as s_t = sg(s) · π_t / sg(π_t): its value is s on every token and its gradient is
    s · ∇log π_t, so with `seq-mean-token-mean` (GSPO's definition) the gradient equals that of the
    sequence-level objective exactly. Clipping is on s with GSPO's small bounds; `clip_ratio_c` is unused.
    `pg_clipfrac_lower` is 0 (no dual-clip).
    """
    del clip_ratio_c
    _check_clip(clip_ratio_low, clip_ratio_high, None)
    if loss_agg_mode != "seq-mean-token-mean":
        _warn_gspo_mode(loss_agg_mode)
    m = response_mask.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    lengths = m.sum(-1)
    seq_log_ratio = (log_ratio * m).sum(-1) / torch.where(lengths > 0, lengths, torch.ones_like(lengths))
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach()[:, None]
    ratio = torch.exp(torch.clamp(token_log_ratio, max=_LOG_RATIO_CLAMP))
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(loss_unclipped, loss_clipped)
    metrics = {
        "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), m).detach(),
        "pg_clipfrac_lower": torch.zeros((), device=ratio.device),
        "ppo_kl": masked_mean(-log_ratio, m).detach(),
    }
    return _aggregate(pg_losses, m, rollout_is_weights, loss_agg_mode, global_normalizer, max_len), metrics


@functools.cache
def _warn_gspo_mode(mode: str) -> None:
    logger.warning(
        "gspo with actor.loss_agg_mode=%s: GSPO is defined with seq-mean-token-mean; other modes weight "
        "sequences by length", mode,
    )


@POLICY_LOSSES.register("cispo")
def cispo_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    global_normalizer: Tensor | float | None = None,
    max_len: int | None = None,
    rollout_is_weights: Tensor | None = None,
    **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): the importance weight is capped at 1 + high and used as a constant,
    token loss = -sg(min(r, 1 + high)) · A · log π. Unlike PPO's clip, no token loses its gradient: a token whose
    ratio rose past the bound still contributes A · ∇log π, scaled by the bound. No lower bound, as in the paper's
    runs (ε_low "set to a large value"): a floor of 1 - low would raise the weight of tokens the update already
    pushed down (A < 0, r < 1 - low) and push on them harder: off-policy from the stage-2 checkpoint the floor 0.8
    left one seed in five at 95.7%, outside GRPO's spread (docs/benchmarks.md, "CISPO and SAPO").
    `clip_ratio_low` and `clip_ratio_c` are unused; `pg_clipfrac`: share of tokens whose weight was capped;
    `pg_clipfrac_lower`: 0.
    """
    del clip_ratio_c, clip_ratio_low
    _check_clip(0.0, clip_ratio_high, None)
    m = response_mask
    log_ratio = torch.clamp(log_prob - old_log_prob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio).detach()
    weight = torch.clamp(ratio, max=1 + clip_ratio_high)
    pg_losses = -weight * advantages * log_prob
    metrics = {
        "pg_clipfrac": masked_mean((weight != ratio).float(), m).detach(),
        "pg_clipfrac_lower": torch.zeros((), device=ratio.device),
        "ppo_kl": masked_mean(-log_ratio, m).detach(),
    }
    return _aggregate(pg_losses, m, rollout_is_weights, loss_agg_mode, global_normalizer, max_len), metrics


@POLICY_LOSSES.register("sapo")
def sapo_policy_loss(
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    loss_agg_mode: str = "token-mean",
    global_normalizer: Tensor | float | None = None,
    max_len: int | None = None,
    rollout_is_weights: Tensor | None = None,
    **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347): a smooth gate instead of a hard clip, token loss
    = -f(r) · A with f(r) = (4 / τ) · σ(τ (r - 1)), τ = `tau_pos` where A > 0 and `tau_neg` (≥ tau_pos: negative
    advantages are damped faster) elsewhere. At r = 1 the gradient is A · ∇log π, as PPO's; it fades smoothly as r
    leaves 1 instead of dropping to 0 at a bound. No hard clip: `pg_clipfrac` / `pg_clipfrac_lower` report the
    share of tokens with r above 1 + `clip_ratio_high` / below 1 - `clip_ratio_low` (diagnostics only);
    `clip_ratio_c` is unused.
    """
    del clip_ratio_c
    _check_clip(clip_ratio_low, clip_ratio_high, None)
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"actor.tau_pos={tau_pos}, actor.tau_neg={tau_neg}: SAPO's temperatures must be > 0 "
                         "(the paper uses 1.0 and 1.05)")
    m = response_mask
    log_ratio = torch.clamp(log_prob - old_log_prob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1)) * (4 / tau)
    pg_losses = -gate * advantages
    metrics = {
        "pg_clipfrac": masked_mean((ratio > 1 + clip_ratio_high).float(), m).detach(),
        "pg_clipfrac_lower": masked_mean((ratio < 1 - clip_ratio_low).float(), m).detach(),
        "ppo_kl": masked_mean(-log_ratio, m).detach(),
    }
    return _aggregate(pg_losses, m, rollout_is_weights, loss_agg_mode, global_normalizer, max_len), metrics
