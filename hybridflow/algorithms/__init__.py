"""Core RL algorithms as pure tensor functions plus name registries (advantages, losses, KL).

Extend by registering: `@ADVANTAGE_ESTIMATORS.register("mine")`, `@POLICY_LOSSES.register("mine")`,
`@KL_ESTIMATORS.register("mine")`; an unknown name raises a KeyError listing the registered ones.
"""

from hybridflow.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    compute_advantage,
    gae_advantage,
    grpo_advantage,
    reinforce_plus_plus_advantage,
    reinforce_plus_plus_baseline_advantage,
    remax_advantage,
    rloo_advantage,
)
from hybridflow.algorithms.aggregation import (
    LOSS_AGG_MODES,
    agg_loss,
    global_loss_normalizer,
    loss_normalizer,
)
from hybridflow.algorithms.dapo import filter_uninformative_groups, overlong_penalty
from hybridflow.algorithms.discounted import discounted_reverse_cumsum, masked_discounted_returns
from hybridflow.algorithms.grouping import GroupStats, group_stats
from hybridflow.algorithms.kl import KL_ESTIMATORS, kl_penalty
from hybridflow.algorithms.kl_controller import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
)
from hybridflow.algorithms.masked import (
    entropy_from_logits,
    entropy_from_logits_chunked,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from hybridflow.algorithms.policy_loss import POLICY_LOSSES, PolicyLoss, gspo_policy_loss, vanilla_policy_loss
from hybridflow.algorithms.rollout_is import (
    ROLLOUT_IS_MODES,
    rollout_is_metrics,
    rollout_is_ratio,
    rollout_is_weights,
)
from hybridflow.algorithms.value_loss import compute_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "ROLLOUT_IS_MODES",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "GroupStats",
    "PolicyLoss",
    "agg_loss",
    "apply_kl_penalty",
    "build_kl_controller",
    "compute_advantage",
    "compute_value_loss",
    "discounted_reverse_cumsum",
    "entropy_from_logits",
    "entropy_from_logits_chunked",
    "filter_uninformative_groups",
    "gae_advantage",
    "global_loss_normalizer",
    "group_stats",
    "grpo_advantage",
    "gspo_policy_loss",
    "kl_penalty",
    "loss_normalizer",
    "masked_discounted_returns",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "reinforce_plus_plus_advantage",
    "reinforce_plus_plus_baseline_advantage",
    "remax_advantage",
    "rloo_advantage",
    "rollout_is_metrics",
    "rollout_is_ratio",
    "rollout_is_weights",
    "vanilla_policy_loss",
]
