"""`REWARD_FUNCTIONS` (name → scorer) and `select_reward_fn(data_source)`.

Every scorer has verl's signature `fn(data_source, solution_str, ground_truth, extra_info) -> float | dict` (a
dict carries the reward under "score" plus extra per-row numbers). Built-in scorers register themselves when
their module is imported; `load_builtin_scorers()` imports them all (cheap: no torch), which is also what the
reward worker processes do.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from hybridflow.utils.registry import Registry

RewardFn = Callable[[str, str, Any, dict[str, Any] | None], "float | dict[str, Any]"]
REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function")

BUILTIN_MODULES = ("gsm8k", "math", "countdown", "synthetic", "code", "tool_task")

# data_source (as written in verl-schema parquet) → REWARD_FUNCTIONS name.
DATA_SOURCES: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "hendrycks/competition_math": "math",
    "math": "math",
    "countdown": "countdown",
    "Jiayi-Pan/Countdown-Tasks-3to4": "countdown",
    "hybridflow/arithmetic": "arithmetic",
    "hybridflow/sort": "sort",
    "hybridflow/countdown": "countdown",
    "hybridflow/tool_calculator": "tool_calculator",
    "hybridflow/colour_count": "colour_count",
}


def load_builtin_scorers() -> None:
    for name in BUILTIN_MODULES:
        importlib.import_module(f"hybridflow.rewards.{name}")


def get_reward_fn(name: str) -> RewardFn:
    """The registered scorer `name` (KeyError listing the registered names on a miss)."""
    load_builtin_scorers()
    return REWARD_FUNCTIONS[name]


def reward_fn_name(data_source: str) -> str:
    """The REWARD_FUNCTIONS name for a data_source: the table above, else the data_source itself if registered."""
    load_builtin_scorers()
    name = DATA_SOURCES.get(data_source, data_source)
    if name not in REWARD_FUNCTIONS:
        raise ValueError(
            f"no reward function for data_source={data_source!r}. Known data sources: {', '.join(sorted(DATA_SOURCES))}"
            f"; registered functions: {', '.join(REWARD_FUNCTIONS.names())}. Fix: set reward.sources to "
            "[{name: custom, weight: 1.0}] with reward.custom.path, or register a function under that name")
    return name


def select_reward_fn(data_source: str) -> RewardFn:
    """The scorer for rows of `data_source`."""
    return REWARD_FUNCTIONS[reward_fn_name(data_source)]
