"""Scorers of the built-in tasks (`hybridflow.data.tasks`): 1.0 when the text after the last "####" is the
ground truth, else 0.0."""

from __future__ import annotations

import re
from typing import Any

from hybridflow.rewards.registry import REWARD_FUNCTIONS

_ANSWER = re.compile(r"####\s*([^\n#]*)")


def final_answer(solution: str) -> str | None:
    found = _ANSWER.findall(solution[-200:])
    return " ".join(found[-1].split()) if found else None


@REWARD_FUNCTIONS.register("arithmetic")
def arithmetic(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    answer = final_answer(solution_str)
    return float(answer is not None and answer.rstrip(".") == str(ground_truth).strip())


@REWARD_FUNCTIONS.register("sort")
def sort(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    answer = final_answer(solution_str)
    return float(answer is not None and answer.rstrip(".") == " ".join(str(ground_truth).split()))
