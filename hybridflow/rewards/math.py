"""MATH scorer: compares the last `\\boxed{...}` of the response with the ground truth.

With the `math` extra (math-verify) answers are compared symbolically (`\\frac{1}{2}` == `0.5`, `\\sqrt{3}/2` ==
`\\frac{\\sqrt{3}}{2}`); math-verify's own signal-based timeouts are disabled because the reward manager bounds
every call. Without it, a documented normaliser is used: Hendrycks-style string clean-up (spaces, `\\left`/`\\right`,
`\\dfrac`, units in `\\text{}`, degrees, `$`, `%`, a leading `x=`) and then numeric comparison of plain numbers and
simple fractions (`a/b`, `\\frac{a}{b}`).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from hybridflow.rewards.registry import REWARD_FUNCTIONS

try:
    import math_verify.grader
    import math_verify.parser
    from math_verify import parse as _mv_parse
    from math_verify import verify as _mv_verify

    # We pass timeouts=None on purpose (the reward manager bounds every call); skip its "timeout disabled" warning.
    math_verify.grader.TIMEOUT_WARNING_SHOWN = math_verify.parser.TIMEOUT_WARNING_SHOWN = True
except ImportError:  # the `math` extra is optional
    _mv_parse = _mv_verify = None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (balanced braces), or `\\boxed x` up to `$`."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    brace = rest.find("{")
    if rest.startswith("\\boxed ") and (brace < 0 or brace > len("\\boxed ")):
        return rest[len("\\boxed "):].split("$")[0].strip()
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(rest)):
        depth += {"{": 1, "}": -1}.get(rest[i], 0)
        if depth == 0:
            return rest[brace + 1:i]
    return None


_REMOVE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\$", "$", "\\%", "%", "^\\circ", "^{\\circ}", "\\displaystyle")


def normalize(answer: str) -> str:
    """String normal form of an answer (the fallback when math-verify is absent)."""
    s = answer.strip().replace("\n", "")
    s = re.sub(r"\\text\{\s*[a-zA-Z ]*\}$", "", s)  # trailing units
    s = re.sub(r"\\(?:text|textbf|mathrm)\{([^{}]*)\}", r"\1", s)
    for token in _REMOVE:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    if re.fullmatch(r"[a-zA-Z]\w*=.+", s) and len(s.split("=")[0]) <= 2:
        s = s.split("=", 1)[1]
    if s.startswith("."):
        s = "0" + s
    return s.rstrip(".")


def _as_number(s: str) -> Fraction | None:
    s = s.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s) else s
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s) or re.fullmatch(r"(-?)(-?\d+)/(-?\d+)", s)
    try:
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def equivalent_fallback(answer: str, truth: str) -> bool:
    a, t = normalize(answer), normalize(truth)
    if a == t:
        return True
    na, nt = _as_number(a), _as_number(t)
    return na is not None and nt is not None and na == nt


def equivalent(answer: str, truth: str) -> bool:
    """math-verify when installed (then the fallback for what it cannot parse), else the fallback."""
    if _mv_parse is not None:
        gold = _mv_parse(f"${truth}$", parsing_timeout=None)
        pred = _mv_parse(f"${answer}$", parsing_timeout=None)
        if gold and pred and _mv_verify(gold, pred, timeout_seconds=None):
            return True
    return equivalent_fallback(answer, truth)


@REWARD_FUNCTIONS.register("math")
def math_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    boxed_truth = last_boxed(truth)
    return float(equivalent(answer, boxed_truth if boxed_truth is not None else truth))
