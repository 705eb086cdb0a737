"""Reward functions (registry + built-in scorers), custom `compute_score` loading, the reward manager."""

from hybridflow.rewards.manager import RewardManager, RewardOutput
from hybridflow.rewards.registry import (
    DATA_SOURCES,
    REWARD_FUNCTIONS,
    get_reward_fn,
    load_builtin_scorers,
    select_reward_fn,
)

load_builtin_scorers()

__all__ = ["DATA_SOURCES", "REWARD_FUNCTIONS", "RewardManager", "RewardOutput", "get_reward_fn",
           "load_builtin_scorers", "select_reward_fn"]
