"""Scorers of the built-in tasks (`hybridflow.data.tasks`).

`sort` and `colour_count`: 1.0 when the text after the last "####" is the ground truth, else 0.0. `arithmetic` returns
`{"score", "acc"}`: `acc` is the exact match (what validation accuracy reports); `score` is 1.0 for an exact answer
and otherwise partial credit, 0.5 × the fraction of digits right (aligned from the units digit). Decision: a small
model that gets sums nearly right (150 for 152) would otherwise see almost only zero rewards, and GRPO groups of
all-zero rewards carry no gradient; digit credit gives it a signal for the units and tens digits separately.
"""

from __future__ import annotations

import re
from typing import Any

from hybridflow.rewards.registry import REWARD_FUNCTIONS

_ANSWER = re.compile(r"####\s*([^\n#]*)")


def final_answer(solution: str) -> str | None:
    found = _ANSWER.findall(solution[-200:])
    return " ".join(found[-1].split()) if found else None


def digit_credit(answer: str, truth: str) -> float:
    """Fraction of digit positions (aligned from the right) where `answer` matches `truth`; 0 for a non-number."""
    if not answer.isdigit() or not truth.isdigit():
        return 0.0
    width = max(len(answer), len(truth))
    right = sum(a == b for a, b in zip(reversed(answer), reversed(truth)))
    return right / width


@REWARD_FUNCTIONS.register("arithmetic")
def arithmetic(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    answer = final_answer(solution_str)
    truth = str(ground_truth).strip()
    if answer is None:
        return {"score": 0.0, "acc": 0.0}
    answer = answer.rstrip(".")
    exact = answer == truth
    return {"score": 1.0 if exact else 0.5 * digit_credit(answer, truth), "acc": float(exact)}


@REWARD_FUNCTIONS.register("sort")
def sort(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    answer = final_answer(solution_str)
    return float(answer is not None and answer.rstrip(".") == " ".join(str(ground_truth).split()))


@REWARD_FUNCTIONS.register("colour_count")
def colour_count(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    answer = final_answer(solution_str)
    exact = float(answer is not None and answer.rstrip(".") == str(ground_truth).strip())
    return {"score": exact, "acc": exact}
