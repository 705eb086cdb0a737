"""Per-token KL estimators KL(π‖π_ref) from sampled log-probs (Schulman's k1/k2/k3), in `KL_ESTIMATORS`.

Used both as the in-reward penalty (`apply_kl_penalty`) and as the actor's KL loss term (`actor.use_kl_loss`,
`kl_loss_type`). Decision: k3 clamps the log-ratio to ±20 before `exp` and the result to ±10, so one wild
token cannot blow up the loss; `k3+` keeps k3's value with k2's unbiased gradient (straight-through).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from hybridflow.utils.registry import Registry

KLEstimator = Callable[[Tensor, Tensor], Tensor]
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")

K3_CLAMP = 10.0
_LOG_RATIO_CLAMP = 20.0


@KL_ESTIMATORS.register("k1", "kl")
def kl_k1(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    """log π - log π_ref (unbiased, high variance, can be negative)."""
    return logprob - ref_logprob


@KL_ESTIMATORS.register("abs")
def kl_abs(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    """|log π - log π_ref|."""
    return (logprob - ref_logprob).abs()


@KL_ESTIMATORS.register("k2", "mse")
def kl_k2(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    """½ (log π - log π_ref)²."""
    return 0.5 * (logprob - ref_logprob).square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def kl_k3(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    """exp(ref - logp) - (ref - logp) - 1: non-negative, low variance; clamped to ±10."""
    log_ratio = torch.clamp(ref_logprob - logprob, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return torch.clamp(log_ratio.exp() - log_ratio - 1, -K3_CLAMP, K3_CLAMP)


@KL_ESTIMATORS.register("k3+", "low_var_kl+")
def kl_k3_plus(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    """Value of k3, gradient of k2 (unbiased gradient of KL when used as a loss)."""
    k2 = kl_k2(logprob, ref_logprob)
    return kl_k3(logprob, ref_logprob).detach() + k2 - k2.detach()


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kind: str = "kl") -> Tensor:
    """Per-token KL estimate of kind `kind` (a `KL_ESTIMATORS` name); same shape as the inputs."""
    if logprob.shape != ref_logprob.shape:
        raise ValueError(f"logprob {tuple(logprob.shape)} and ref_logprob {tuple(ref_logprob.shape)} differ")
    return KL_ESTIMATORS[kind](logprob, ref_logprob)
