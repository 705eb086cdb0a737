"""KL-coefficient controllers (fixed; adaptive per Ziegler et al. 2019) and the KL-in-reward penalty.

Decision: controllers are tiny stateful objects with `state_dict()`/`load_state_dict()` so the current
coefficient is checkpointed with the trainer; `build_kl_controller` reads `algorithm.kl_ctrl` (a `KLCtrlConfig`:
`type: fixed | adaptive`, `kl_controller` accepted by the config as an alias of `adaptive`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from torch import Tensor

from hybridflow.algorithms.kl import kl_penalty
from hybridflow.algorithms.masked import masked_mean


class KLCtrlSection(Protocol):
    """What the controllers read from `algorithm.kl_ctrl` (config.schema.KLCtrlConfig; algorithms sit below config,
    which checks algorithm names against their registries)."""

    @property
    def type(self) -> str: ...
    @property
    def kl_coef(self) -> float: ...
    @property
    def target_kl(self) -> float: ...
    @property
    def horizon(self) -> int: ...

ADAPTIVE_ERR_CLIP = 0.2


class FixedKLController:
    """Constant coefficient; `update` is a no-op."""

    kind = "fixed"

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps

    def state_dict(self) -> dict[str, Any]:
        return {"type": self.kind, "value": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("type", self.kind) != self.kind:
            raise ValueError(f"checkpoint holds a {state.get('type')!r} KL controller, config asks for {self.kind!r}")
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Proportional controller: err = clip(kl / target - 1, ±0.2); value *= 1 + err · n_steps / horizon."""

    kind = "adaptive"

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if target_kl <= 0:
            raise ValueError(f"algorithm.kl_ctrl.target_kl={target_kl} must be > 0 for an adaptive controller")
        if horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon={horizon} must be > 0 for an adaptive controller")
        super().__init__(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        err = min(max(float(current_kl) / self.target - 1.0, -ADAPTIVE_ERR_CLIP), ADAPTIVE_ERR_CLIP)
        self.value *= 1.0 + err * n_steps / self.horizon


def build_kl_controller(cfg: KLCtrlSection) -> FixedKLController:
    """Controller for `algorithm.kl_ctrl` (the config has checked its type and resolved the alias)."""
    if cfg.type == "fixed":
        return FixedKLController(cfg.kl_coef)
    if cfg.type == "adaptive":
        return AdaptiveKLController(cfg.kl_coef, cfg.target_kl, cfg.horizon)
    raise ValueError(f"algorithm.kl_ctrl.type={cfg.type!r} is not supported; use fixed or adaptive")


def apply_kl_penalty(
    token_level_scores: Tensor,
    old_log_prob: Tensor,
    ref_log_prob: Tensor,
    response_mask: Tensor,
    kl_ctrl: FixedKLController,
    kl_penalty_type: str = "kl",
    update: bool = True,
) -> tuple[Tensor, dict[str, float]]:
    """KL-in-reward: rewards = scores - β·KL per token, β = the controller's current value.

    Then (if `update`) advances the controller with the batch KL — the mean over sequences of each sequence's
    mean token KL — and n_steps = batch size (number of responses), as in Ziegler et al.
    Metrics: `actor/reward_kl_penalty` (that KL) and `actor/reward_kl_penalty_coeff` (β used here).
    """
    m = response_mask.to(token_level_scores.dtype)
    kld = kl_penalty(old_log_prob.detach(), ref_log_prob.detach(), kl_penalty_type) * m
    beta = kl_ctrl.value
    rewards = token_level_scores - beta * kld
    current_kl = float(masked_mean(kld, m, dim=-1).mean()) if kld.numel() else 0.0
    if update:
        kl_ctrl.update(current_kl=current_kl, n_steps=int(token_level_scores.shape[0]))
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": float(beta)}
    return rewards, metrics

