"""Countdown scorer (TinyZero format): the equation in the last `<answer>...</answer>` must use each given number
exactly once and evaluate to the target. 1.0 correct, 0.1 well-formed but wrong, 0.0 no parsable equation.
Evaluation walks the AST (numbers, + - * /, parentheses only) — never `eval`.
"""

from __future__ import annotations

import ast
import operator
import re
from collections import Counter
from typing import Any

from hybridflow.rewards.registry import REWARD_FUNCTIONS

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
FORMAT_SCORE = 0.1


def extract_equation(solution: str) -> str | None:
    found = _ANSWER.findall(solution[-1000:])
    return found[-1].strip() if found else None


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    raise ValueError(f"disallowed expression node {type(node).__name__}")


def evaluate(equation: str) -> float | None:
    """Value of an arithmetic expression, or None if it is not one (or divides by zero)."""
    if len(equation) > 200 or not re.fullmatch(r"[\d+\-*/().\s]+", equation):
        return None
    try:
        return _eval(ast.parse(equation, mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None


def _target_numbers(ground_truth: Any) -> tuple[float, list[int]]:
    if not isinstance(ground_truth, dict) or "target" not in ground_truth:
        raise ValueError(f"countdown ground_truth must be a dict with 'target' and 'numbers', got {ground_truth!r}")
    return float(ground_truth["target"]), [int(x) for x in ground_truth["numbers"]]


@REWARD_FUNCTIONS.register("countdown")
def countdown(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    target, numbers = _target_numbers(ground_truth)
    equation = extract_equation(solution_str)
    if equation is None:
        return 0.0
    used = [int(x) for x in re.findall(r"\d+", equation)]
    value = evaluate(equation)
    if value is None:
        return 0.0
    if Counter(used) != Counter(numbers):
        return FORMAT_SCORE
    return 1.0 if abs(value - target) < 1e-5 else FORMAT_SCORE
