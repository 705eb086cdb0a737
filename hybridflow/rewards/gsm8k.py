"""GSM8K scorer: `strict` reads the number after the last "#### " (the format the prompt asks for); `flexible`
takes the last number anywhere in the response. Numbers compare by value ("1,000" == "1000.0")."""

from __future__ import annotations

import re
from typing import Any

from hybridflow.rewards.registry import REWARD_FUNCTIONS

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
_TAIL_CHARS = 300  # answers sit at the end; bounding the text bounds the regex cost on runaway responses


def extract_answer(solution: str, method: str = "strict") -> str | None:
    """The answer string (commas removed, trailing '.' dropped) or None when there is none."""
    text = solution[-_TAIL_CHARS:]
    if method == "strict":
        found = _STRICT.findall(text)
    elif method == "flexible":
        found = [m for m in _NUMBER.findall(text) if m.strip(".,")]
    else:
        raise ValueError(f"gsm8k method={method!r}: must be 'strict' or 'flexible'")
    if not found:
        return None
    return found[-1].replace(",", "").rstrip(".") or None


def _same_number(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def compute_score(solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    truth = str(ground_truth).replace(",", "").strip()
    return score if _same_number(answer, truth) else format_score


@REWARD_FUNCTIONS.register("gsm8k")
def gsm8k(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    return compute_score(solution_str, ground_truth, "strict")


@REWARD_FUNCTIONS.register("gsm8k_flexible")
def gsm8k_flexible(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    return compute_score(solution_str, ground_truth, "flexible")
