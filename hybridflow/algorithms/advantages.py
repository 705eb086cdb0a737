"""Advantage estimators, registered by name in `ADVANTAGE_ESTIMATORS`.

Every estimator takes one uniform keyword set and ignores what it does not use, so the trainer calls
`compute_advantage(cfg.algorithm.adv_estimator, **everything)`; each returns `(advantages, returns)`, both
[B, T] float32 and exactly 0 outside `response_mask`. Sequence-level ("outcome") estimators use the masked sum
of token rewards as the sequence score. Legend: B batch (responses), T response length.

`distill` (on-policy distillation) is per token: the teacher's minus the student's log-prob of each sampled token.

Groups of size 1 (one response per uid): `grpo` and `rloo` give advantage 0 (no baseline can be formed);
`reinforce_plus_plus_baseline` subtracts the group mean (= the score itself, so 0) before batch whitening.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from hybridflow.algorithms.discounted import (
    discounted_reverse_cumsum,
    is_contiguous_mask,
    masked_discounted_returns,
    pack_left,
)
from hybridflow.algorithms.grouping import group_stats
from hybridflow.algorithms.masked import masked_whiten
from hybridflow.utils.registry import Registry

GRPO_EPS = 1e-6


class AdvantageEstimator(Protocol):
    def __call__(self, *, token_level_rewards: Tensor, response_mask: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor]:
        ...


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def compute_advantage(name: str, **kwargs: Any) -> tuple[Tensor, Tensor]:
    """Look up estimator `name` (KeyError lists the registered names) and call it with `kwargs`."""
    return ADVANTAGE_ESTIMATORS[name](**kwargs)


def _prep(token_level_rewards: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    if token_level_rewards.shape != response_mask.shape or token_level_rewards.ndim != 2:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be [batch, response_len]"
        )
    return token_level_rewards.float(), response_mask.float()


def _require_index(index: np.ndarray | Sequence | Tensor | None, name: str, batch: int) -> Any:
    if index is None or len(index) != batch:
        got = None if index is None else len(index)
        raise ValueError(f"{name} needs index (one prompt uid per row, length {batch}); got length {got}")
    return index


def _sequence_scores(rewards_BT: Tensor, mask_BT: Tensor) -> Tensor:
    return (rewards_BT * mask_BT).sum(-1)


@ADVANTAGE_ESTIMATORS.register("gae")
def gae_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation; returns = raw advantages + values, advantages then batch-whitened.

    Masked tokens are skipped: the value after the last valid token is 0 and a masked token between valid ones
    (multi-turn observation) neither discounts nor contributes. Runs as a vectorised discounted scan.
    """
    r, m = _prep(token_level_rewards, response_mask)
    if values is None or values.shape != r.shape:
        got = None if values is None else tuple(values.shape)
        raise ValueError(f"gae needs critic values shaped {tuple(r.shape)}, got {got}; set critic or use grpo")
    with torch.no_grad():
        raw, returns = _gae_raw(r, m, values.detach().float(), gamma, lam)
        return masked_whiten(raw, m).mul_(m), returns


def _gae_raw(r: Tensor, m: Tensor, v: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Un-whitened GAE advantages and returns; holes in the mask are packed away first."""
    if not is_contiguous_mask(m):
        order = pack_left(m)
        adv, ret = _gae_raw(r.gather(1, order), m.gather(1, order), v.gather(1, order), gamma, lam)
        return torch.zeros_like(adv).scatter_(1, order, adv), torch.zeros_like(ret).scatter_(1, order, ret)
    vm = v * m
    # delta_t = r_t + γ·V_{t+1} - V_t. A masked position before a block (left padding) may get a non-zero
    # delta, but the reverse scan only carries it to earlier, also masked, positions.
    delta = r * m
    delta.sub_(vm)
    delta[:, :-1].add_(vm[:, 1:], alpha=gamma)
    adv = discounted_reverse_cumsum(delta, gamma * lam).mul_(m)
    return adv, adv + vm


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray | Sequence | Tensor | None = None,
    norm_adv_by_std: bool = True,
    epsilon: float = GRPO_EPS,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """(score - group mean) / (group std + eps); without the division when `norm_adv_by_std=False` (Dr.GRPO).

    Group std is the unbiased (Bessel) std. Groups of size 1 get advantage 0. returns == advantages.
    """
    r, m = _prep(token_level_rewards, response_mask)
    index = _require_index(index, "grpo", r.shape[0])
    with torch.no_grad():
        scores = _sequence_scores(r, m)
        st = group_stats(scores, index)
        adv = scores - st.mean
        if norm_adv_by_std:
            adv = adv / (st.std + epsilon)
        adv = torch.where(st.count > 1, adv, torch.zeros_like(adv))
        adv_BT = adv[:, None] * m
    return adv_BT, adv_BT


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray | Sequence | Tensor | None = None,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """score minus the mean score of the *other* responses of the group: n/(n-1) · (score - group mean).

    Groups of size 1 have no other response, so their advantage is 0. returns == advantages.
    """
    r, m = _prep(token_level_rewards, response_mask)
    index = _require_index(index, "rloo", r.shape[0])
    with torch.no_grad():
        scores = _sequence_scores(r, m)
        st = group_stats(scores, index)
        n = st.count
        adv = torch.where(n > 1, (scores - st.mean) * n / (n - 1).clamp(min=1), torch.zeros_like(scores))
        adv_BT = adv[:, None] * m
    return adv_BT, adv_BT


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    gamma: float = 1.0,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted token reward-to-go (masked tokens skipped), whitened over the whole batch.

    returns are the un-whitened discounted returns.
    """
    r, m = _prep(token_level_rewards, response_mask)
    with torch.no_grad():
        returns = masked_discounted_returns(r, m, gamma)
        adv = masked_whiten(returns, m) * m
    return adv, returns


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray | Sequence | Tensor | None = None,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: score minus group mean, broadcast to tokens, then whitened over the batch.

    Groups of size 1 are 0 before whitening (their mean is their score). returns == advantages.
    """
    r, m = _prep(token_level_rewards, response_mask)
    index = _require_index(index, "reinforce_plus_plus_baseline", r.shape[0])
    with torch.no_grad():
        scores = _sequence_scores(r, m)
        st = group_stats(scores, index)
        adv_BT = (scores - st.mean)[:, None] * m
        adv_BT = masked_whiten(adv_BT, m) * m
    return adv_BT, adv_BT


@ADVANTAGE_ESTIMATORS.register("remax")
def remax_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    baseline_rewards: Tensor | None = None,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """ReMax: undiscounted reward-to-go minus the greedy response's reward (`baseline_rewards`, [B]).

    returns are the reward-to-go before the baseline is subtracted.
    """
    r, m = _prep(token_level_rewards, response_mask)
    if baseline_rewards is None or baseline_rewards.shape != (r.shape[0],):
        got = None if baseline_rewards is None else tuple(baseline_rewards.shape)
        raise ValueError(
            f"remax needs baseline_rewards shaped ({r.shape[0]},) (reward of the greedy response per prompt), "
            f"got {got}"
        )
    with torch.no_grad():
        returns = masked_discounted_returns(r, m, 1.0)
        adv = (returns - baseline_rewards.float()[:, None]) * m
    return adv, returns


@ADVANTAGE_ESTIMATORS.register("distill")
def distill_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    teacher_log_probs: Tensor | None = None,
    log_probs: Tensor | None = None,
    task_reward_weight: float = 0.0,
    index: np.ndarray | Sequence | Tensor | None = None,
    norm_adv_by_std: bool = True,
    **_: Any,
) -> tuple[Tensor, Tensor]:
    """On-policy distillation: log π_teacher(y_t) − log π_student(y_t) at each sampled token (the negative
    reverse-KL estimate), plus `task_reward_weight` × the GRPO advantage of the task reward.

    Undiscounted and per token, not a reward-to-go: each token is credited with its own divergence only (the
    teacher already judges every prefix, so summing later tokens' terms adds variance, not signal). Not whitened:
    the log-ratio's sign and size are the signal (a whitened advantage would push up tokens both models agree on
    whenever the batch mean is negative). `log_probs` are the sampling policy's. returns == advantages.
    """
    r, m = _prep(token_level_rewards, response_mask)
    for name, lp in (("teacher_log_probs", teacher_log_probs), ("log_probs", log_probs)):
        if lp is None or lp.shape != r.shape:
            got = None if lp is None else tuple(lp.shape)
            raise ValueError(f"distill needs {name} shaped {tuple(r.shape)} (the teacher's and the sampling policy's "
                             f"log-probs of the sampled tokens), got {got}; set teacher.model_path")
    with torch.no_grad():
        adv_BT = (teacher_log_probs.float() - log_probs.float()) * m
        if task_reward_weight:
            task_BT, _ = grpo_advantage(token_level_rewards=r, response_mask=m, index=index,
                                        norm_adv_by_std=norm_adv_by_std)
            adv_BT = adv_BT + task_reward_weight * task_BT
    return adv_BT, adv_BT
