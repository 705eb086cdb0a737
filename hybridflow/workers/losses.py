"""The actor's and critic's losses (`engine.LossFn`) handed to `TrainEngine.forward_backward`.

Each gets the engine's outputs for one micro-batch, the micro-batch itself and the mini-batch's global
normaliser (so gradient accumulation and data parallelism give the whole-batch gradient) and returns
`(loss, metrics)`. Metric values are this micro-batch's share; the engine sums shares and averages the rest.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.algorithms import (
    POLICY_LOSSES,
    PolicyLoss,
    agg_loss,
    compute_value_loss,
    kl_penalty,
    loss_normalizer,
    rollout_is_weights,
)
from hybridflow.config.schema import ActorConfig, CriticConfig, RolloutISConfig
from hybridflow.engine.moe_replay import AGREEMENT
from hybridflow.protocol import DataProto, keys


def _norm(global_norm: Any, mode: str) -> Any:
    """The engine passes one normaliser per aggregation mode; take the one this loss aggregates with."""
    return global_norm[mode] if isinstance(global_norm, dict) else global_norm


def _local_mean(share: torch.Tensor, mask: torch.Tensor, mode: str, global_norm: Any) -> torch.Tensor:
    """A loss term aggregated with the global normaliser is this micro-batch's *share* of the mini-batch value;
    for reporting, turn it back into this micro-batch's own mean so averaging over micro-batches and ranks reads
    as a mean whatever the split (the optimised loss is unchanged)."""
    g = _norm(global_norm, mode)
    if g is None:
        return share.detach()
    local = loss_normalizer(mask, mode).clamp(min=1)
    return (share.detach() * g / local).to(share.dtype)


@dataclass(frozen=True)
class ActorLoss:
    """PPO/GRPO actor loss: `policy_loss` (resolved once from `actor.policy_loss` by `make_actor_loss`) on the
    advantages, minus the entropy bonus, plus the KL loss to the reference when `use_kl_loss`. `rollout_is` (mode
    set): the off-policy correction between the rollout engine and the trainer — each token's policy-gradient loss
    is weighted by `rollout_is_weights(old_log_probs, rollout_log_probs)` (TIS or mask, algorithms/rollout_is.py);
    its metrics are computed once per step on the driver over the whole batch."""

    cfg: ActorConfig
    policy_loss: PolicyLoss
    max_response_length: int
    use_kl_loss: bool
    rollout_is: RolloutISConfig | None = None
    loss_params: dict[str, float] = field(default_factory=dict)  # actor.* keys the policy loss declares (SAPO's taus)

    def __call__(self, outputs: dict[str, torch.Tensor], mb: DataProto,
                 global_norm: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        cfg = self.cfg
        log_prob = outputs["log_probs"]
        mask = mb.batch[keys.RESPONSE_MASK]
        # Strictly on-policy (one epoch, one mini-batch): the sampling policy is the current one, so the ratio is 1
        # and its gradient is the policy gradient; recomputing old log-probs would only cost a forward pass.
        old = mb.batch[keys.OLD_LOG_PROBS] if keys.OLD_LOG_PROBS in mb.batch else log_prob.detach()
        agg = dict(global_normalizer=_norm(global_norm, cfg.loss_agg_mode), max_len=self.max_response_length)
        is_kw: dict[str, torch.Tensor] = {}
        if self.rollout_is is not None:  # the old_log_prob stage always runs then (Resolved.recompute_old_log_prob)
            is_kw["rollout_is_weights"] = rollout_is_weights(mb.batch[keys.OLD_LOG_PROBS],
                                                             mb.batch[keys.ROLLOUT_LOG_PROBS],
                                                             mask, mode=self.rollout_is.mode, cap=self.rollout_is.cap)
        low = cfg.clip_ratio if cfg.clip_ratio_low is None else cfg.clip_ratio_low
        high = cfg.clip_ratio if cfg.clip_ratio_high is None else cfg.clip_ratio_high
        pg_loss, pg_metrics = self.policy_loss(
            old, log_prob, mb.batch[keys.ADVANTAGES], mask,
            clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode=cfg.loss_agg_mode,
            **agg, **is_kw, **self.loss_params,
        )
        loss = pg_loss
        mode = cfg.loss_agg_mode
        metrics: dict[str, torch.Tensor | float] = {"actor/pg_loss": _local_mean(pg_loss, mask, mode, global_norm)}
        metrics |= {f"actor/{k}": v for k, v in pg_metrics.items()}
        if keys.ENTROPY in outputs:
            entropy = agg_loss(outputs[keys.ENTROPY], mask, cfg.loss_agg_mode, **agg)
            metrics["actor/entropy"] = _local_mean(entropy, mask, mode, global_norm)
            if cfg.entropy_coeff:
                loss = loss - cfg.entropy_coeff * entropy
        if AGREEMENT in outputs:  # MoE with `routed_experts` in the batch (engine/moe_replay.py)
            agree = (outputs[AGREEMENT] * mask).sum() / mask.sum().clamp(min=1)
            metrics["moe/update_routing_agreement"] = agree.detach()
        if self.use_kl_loss:
            kl = kl_penalty(log_prob, mb.batch[keys.REF_LOG_PROB], cfg.kl_loss_type)
            kl_loss = agg_loss(kl, mask, cfg.loss_agg_mode, **agg)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = _local_mean(kl_loss, mask, mode, global_norm)
        return loss, metrics


def make_actor_loss(cfg: ActorConfig, max_response_length: int, use_kl_loss: bool,
                    rollout_is: RolloutISConfig | None = None) -> ActorLoss:
    """The actor's loss with `actor.policy_loss` looked up in `POLICY_LOSSES` (built-ins and plugins' losses)."""
    policy_loss = POLICY_LOSSES[cfg.policy_loss]
    is_mode = rollout_is.mode if rollout_is is not None else None
    if is_mode == "auto":
        raise ValueError("make_actor_loss got algorithm.rollout_is.mode='auto' (undecided): pass the resolved "
                         "config, hybridflow.config.resolved.rollout_is(cfg)")
    if is_mode is not None and "rollout_is_weights" not in inspect.signature(policy_loss).parameters:
        raise ValueError(f"actor.policy_loss={cfg.policy_loss!r} takes no rollout_is_weights parameter, so "
                         f"algorithm.rollout_is.mode={is_mode!r} cannot apply: add the parameter to the loss or set "
                         "algorithm.rollout_is.mode=null")
    declared = inspect.signature(policy_loss).parameters
    params = {k: getattr(cfg, k) for k in LOSS_PARAMS if k in declared}
    return ActorLoss(cfg, policy_loss, max_response_length, use_kl_loss, rollout_is if is_mode is not None else None,
                     params)


LOSS_PARAMS = ("tau_pos", "tau_neg")  # actor.* keys handed to the policy losses that declare them (SAPO)


@dataclass(frozen=True)
class CriticLoss:
    """The clipped value loss (`compute_value_loss`) of the critic's values against the returns."""

    cfg: CriticConfig
    max_response_length: int

    def __call__(self, outputs: dict[str, torch.Tensor], mb: DataProto,
                 global_norm: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        cfg = self.cfg
        vf_loss, m = compute_value_loss(
            outputs[keys.VALUES], mb.batch[keys.RETURNS], mb.batch[keys.VALUES], mb.batch[keys.RESPONSE_MASK],
            cliprange_value=cfg.cliprange_value, loss_agg_mode=cfg.loss_agg_mode,
            global_normalizer=_norm(global_norm, cfg.loss_agg_mode), max_len=self.max_response_length,
        )
        vf_metric = _local_mean(vf_loss, mb.batch[keys.RESPONSE_MASK], cfg.loss_agg_mode, global_norm)
        return vf_loss, {"critic/vf_loss": vf_metric, "critic/vf_clipfrac": m["vf_clipfrac"],
                         "critic/vpred_mean": m["vpred_mean"]}


def make_critic_loss(cfg: CriticConfig, max_response_length: int) -> CriticLoss:
    return CriticLoss(cfg, max_response_length)
