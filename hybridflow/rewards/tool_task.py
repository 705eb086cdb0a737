"""Scorer of the built-in `tool_calculator` task (`hybridflow.data.tool_task`): reward = the exact final answer.

The solution is the whole trajectory (the reward manager decodes up to the last model token, tool responses
included). Tool responses are cut out first, so the answer and the calls are read from the model's own text: a
response cannot supply the "####" answer or count as a call. Besides `score`/`acc` the scorer returns per-row
extras the trainer averages into metrics (`reward/rule/<key>`, `val/rule/<key>`): `called` (the trajectory made a
call), `tool_calls` (how many) and `well_formed` (the share of its calls that parse, name the calculator and give a
string expression; None — left out of the mean — when it made none).
"""

from __future__ import annotations

import re
from typing import Any

from hybridflow.agentic.formats import HermesFormat
from hybridflow.rewards.registry import REWARD_FUNCTIONS
from hybridflow.rewards.synthetic import final_answer

_TOOL_RESPONSE = re.compile(r"<tool_response>.*?</tool_response>", re.DOTALL)
_PARSER = HermesFormat()


def model_text(solution: str) -> str:
    """The trajectory without its tool responses."""
    return _TOOL_RESPONSE.sub("", solution)


@REWARD_FUNCTIONS.register("tool_calculator")
def tool_calculator(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict:
    text = model_text(solution_str)
    calls = _PARSER.parse(text)
    good = sum(c.error is None and c.name == "calculator" and isinstance(c.arguments.get("expression"), str)
               for c in calls)
    answer = final_answer(text)
    exact = float(answer is not None and answer.rstrip(".") == str(ground_truth).strip())
    return {"score": exact, "acc": exact, "called": float(bool(calls)), "tool_calls": len(calls),
            "well_formed": good / len(calls) if calls else None}
