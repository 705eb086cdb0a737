"""Interactions: a simulated user or a game on the other side of a multi-turn rollout.

One `Interaction` object per trajectory: `reset(kwargs) -> first user message | None`, then after every assistant
turn without tool calls `step(assistant_message) -> InteractionStep(observation, reward, done)`. The observation is
appended as a user message through the chat template (masked out of training); `reward` is recorded at the end of
that assistant turn (see `ToolSession`); `done` ends the trajectory. `kwargs` is the row's
`extra_info.interaction_kwargs` (verl's schema: `name` picks the interaction when several are configured; the other
keys are the interaction's per-row arguments, e.g. a ground truth).

Interactions are loaded from `rollout.multi_turn.interaction_config_path`, verl's layout:
`interaction: [{name, class_name, config}]` (`class_name`: a built-in name or `package.module.Class`).
Built-in: `guess_number` (`GuessNumberInteraction`), a higher/lower game with reward 1 on the right guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.agentic.plugins import import_class, yaml_entries

KEY = "rollout.multi_turn.interaction_config_path"


@dataclass(frozen=True)
class InteractionStep:
    observation: str  # the user's next message (ignored when done)
    reward: float = 0.0  # credited to the assistant turn just judged
    done: bool = False  # the trajectory ends after this assistant turn


class Interaction:
    """Base class. A subclass keeps its per-trajectory state on `self`: a fresh object serves each trajectory."""

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.config = dict(config or {})

    def reset(self, kwargs: dict[str, Any]) -> str | None:
        """Start a trajectory from the row's `interaction_kwargs`; return the first user message to add after the
        prompt, or None to start from the prompt as it is. The n samples of one prompt must get the same first
        message (GRPO compares them as answers to one prompt)."""
        return None

    def step(self, assistant_message: str) -> InteractionStep:
        raise NotImplementedError


# ------------------------------------------------------------------------------------------------- built-in
class GuessNumberInteraction(Interaction):
    """A number-guessing game: the secret is `interaction_kwargs.secret` (an integer). The assistant's last integer
    is its guess; the user answers "higher"/"lower" (reward `config.miss_reward`, default 0) or ends the game on the
    right guess (reward `config.hit_reward`, default 1). A turn without a number gets a reminder. `config.intro`
    (default on) makes the first user message state the range `interaction_kwargs.low`..`high` (default 1..100)."""

    def reset(self, kwargs: dict[str, Any]) -> str | None:
        if "secret" not in kwargs:
            raise ValueError("guess_number: extra_info.interaction_kwargs needs `secret` (the integer to guess)")
        self.secret = int(kwargs["secret"])
        self.low, self.high = int(kwargs.get("low", 1)), int(kwargs.get("high", 100))
        if not self.config.get("intro", True):
            return None
        return f"I picked a number from {self.low} to {self.high}. Guess it."

    def step(self, assistant_message: str) -> InteractionStep:
        numbers = re.findall(r"-?\d+", assistant_message)
        miss = float(self.config.get("miss_reward", 0.0))
        if not numbers:
            return InteractionStep("Say a number.", miss)
        guess = int(numbers[-1])
        if guess == self.secret:
            return InteractionStep("Correct!", float(self.config.get("hit_reward", 1.0)), done=True)
        return InteractionStep("Higher." if guess < self.secret else "Lower.", miss)


BUILTIN_INTERACTIONS: dict[str, type[Interaction]] = {"guess_number": GuessNumberInteraction}


# -------------------------------------------------------------------------------------------------- loading
@dataclass(frozen=True)
class InteractionSpec:
    """One configured interaction: a factory of per-trajectory objects."""

    name: str
    cls: type[Interaction]
    config: dict[str, Any]

    def new(self) -> Interaction:
        return self.cls(dict(self.config))


def load_interactions(path: str | Path) -> dict[str, InteractionSpec]:
    """`interaction: [{name, class_name, config}]` from a YAML file; names must be unique (`name` defaults to
    `class_name` for a built-in)."""
    specs: dict[str, InteractionSpec] = {}
    for where, entry in yaml_entries(path, KEY, "interaction", ("name", "class_name", "config")):
        class_name = str(entry["class_name"])
        cls = import_class(class_name, where, BUILTIN_INTERACTIONS, Interaction, "interaction")
        name = str(entry.get("name") or (class_name if class_name in BUILTIN_INTERACTIONS else ""))
        if not name:
            raise ValueError(f"{where}: give a `name` (rows select it with extra_info.interaction_kwargs.name)")
        if name in specs:
            raise ValueError(f"{where}: an interaction named {name!r} is already defined; names must be unique")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ValueError(f"{where}: `config` must be a mapping, got {type(config).__name__}")
        specs[name] = InteractionSpec(name, cls, config)
    return specs


def pick(specs: dict[str, InteractionSpec], kwargs: dict[str, Any], row: int) -> InteractionSpec | None:
    """The interaction of a row: `interaction_kwargs.name`, or the only configured one; None without any."""
    if not specs:
        return None
    name = kwargs.get("name")
    if name is None:
        if len(specs) == 1:
            return next(iter(specs.values()))
        raise ValueError(f"row {row}: several interactions are configured ({', '.join(specs)}); set "
                         "extra_info.interaction_kwargs.name to choose one")
    if name not in specs:
        raise ValueError(f"row {row}: extra_info.interaction_kwargs.name={name!r} is not in {KEY} "
                         f"(configured: {', '.join(specs)})")
    return specs[name]
