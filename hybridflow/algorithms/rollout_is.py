"""Off-policy correction between the rollout engine and the training policy (verl's `rollout_is` / TIS).

The sampler's per-token log-probs (`rollout_log_probs`) and the trainer's recomputed ones (`old_log_probs`) differ
even in sync mode (bf16 engine kernels vs the FSDP forward; later, stale weights in async modes). The per-token
importance ratio ρ = π_old / π_rollout = exp(old_log_probs − rollout_log_probs) corrects the policy gradient:

- `tis` (truncated IS, Yao et al. 2025; verl `rollout_is_mode=truncate`): weight w = min(ρ, C);
- `mask` (masked IS; verl `rollout_is_mode=mask`): w = 1 where ρ ∈ [1/C, C], 0 elsewhere (the token is dropped).

w is detached: it scales each token's policy-gradient loss, it is never differentiated. Dropped/zero-weight tokens
keep their place in the loss normaliser (the loss aggregation is unchanged; their contribution is 0).
Legend: B batch, T response length.
"""

from __future__ import annotations

import torch
from torch import Tensor

ROLLOUT_IS_MODES = ("tis", "mask")

# the log-ratio is clamped before exp(): a numerical guard (a ratio of e^20 is far beyond any cap)
_LOG_RATIO_CLAMP = 20.0


def rollout_is_ratio(old_log_prob: Tensor, rollout_log_prob: Tensor) -> Tensor:
    """ρ = exp(old − rollout) per token (B, T), detached."""
    log_ratio = (old_log_prob.detach() - rollout_log_prob.detach()).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return torch.exp(log_ratio)


def rollout_is_weights(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor, *, mode: str,
                       cap: float) -> Tensor:
    """Per-token weights (B, T) for the policy-gradient loss, 0 on pad tokens, detached."""
    if mode not in ROLLOUT_IS_MODES:
        raise ValueError(f"algorithm.rollout_is.mode={mode!r}: must be one of {ROLLOUT_IS_MODES} (or null = off)")
    ratio = rollout_is_ratio(old_log_prob, rollout_log_prob)
    if mode == "tis":
        w = ratio.clamp(max=cap)
    else:
        w = ((ratio >= 1.0 / cap) & (ratio <= cap)).to(ratio.dtype)
    return w * response_mask.to(w.dtype)


def rollout_is_metrics(old_log_prob: Tensor, rollout_log_prob: Tensor, response_mask: Tensor, *, mode: str,
                       cap: float) -> dict[str, float]:
    """Over the valid tokens of the whole batch: `rollout_is/mean` and `/max` of the raw ratio ρ,
    `rollout_is/clip_frac` the fraction with ρ > C (the tokens TIS truncates) and, in `mask` mode,
    `rollout_is/mask_frac` the fraction dropped (ρ outside [1/C, C])."""
    m = response_mask.bool()
    ratio = rollout_is_ratio(old_log_prob, rollout_log_prob)[m].double()
    if ratio.numel() == 0:
        out = {"rollout_is/mean": 1.0, "rollout_is/max": 1.0, "rollout_is/clip_frac": 0.0}
        return out | ({"rollout_is/mask_frac": 0.0} if mode == "mask" else {})
    out = {"rollout_is/mean": float(ratio.mean()), "rollout_is/max": float(ratio.max()),
           "rollout_is/clip_frac": float((ratio > cap).double().mean())}
    if mode == "mask":
        out["rollout_is/mask_frac"] = float(((ratio < 1.0 / cap) | (ratio > cap)).double().mean())
    return out
