"""Synthetic preference pairs from a built-in task: chosen = the correct answer, rejected = a wrong one.

The preference ("prefer correct arithmetic") is learnable and checkable: the task's rule scorer is the ground
truth, so an RM trained on these pairs can drive PPO and the rule metric measures whether that helped. Wrong
answers mix near misses (±1, ±2, ±10: the carry and last-digit slips a small model makes) with random numbers,
so the RM must look at the number, not at the format.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

NEAR_MISSES = (-10, -2, -1, 1, 2, 10)


def wrong_answer(answer: str, rng: random.Random) -> str:
    """A different non-negative integer answer (near miss half the time, else random in [0, 2·answer+20])."""
    value = int(answer)
    while True:
        if rng.random() < 0.5:
            candidate = value + rng.choice(NEAR_MISSES)
        else:
            candidate = rng.randint(0, 2 * value + 20)
        if candidate != value and candidate >= 0:
            return str(candidate)


def preference_rows(task_rows: Sequence[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """Task rows (with `prompt`, `response` = "#### <answer>", `reward_model.ground_truth`) → rows with
    `prompt`, `chosen`, `rejected` (and the task's other columns). Deterministic in `seed`."""
    rng = random.Random(seed)
    out = []
    for row in task_rows:
        truth = str(row["reward_model"]["ground_truth"])
        if not truth.lstrip("-").isdigit():
            raise ValueError(f"synthetic pairs need integer answers (task arithmetic); got ground truth {truth!r}")
        chosen = row["response"]
        rejected = chosen.replace(truth, wrong_answer(truth, rng))
        out.append({**row, "chosen": chosen, "rejected": rejected})
    return out
