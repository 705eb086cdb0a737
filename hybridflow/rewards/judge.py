"""LLM-as-judge rewards, the text side: filling `reward.judge.template`, parsing verdicts into scores, and the
`JudgeFn` interface the reward manager calls (the model behind it: `trainer/judge.py`).

Decision: a verdict the parser cannot read ("unparsed"), or a row that fails ("error": a filled template longer than
`max_prompt_length`, a parser that raises) scores `reward.judge.fallback_score` and is counted
(`reward/judge_unparsed`, `reward/judge_errors`); training goes on.
"""

from __future__ import annotations

import logging
import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from hybridflow.rewards.custom import import_function

logger = logging.getLogger(__name__)

OK, UNPARSED, ERROR = "ok", "unparsed", "error"
_PLACEHOLDER = re.compile(r"\{(prompt|response|ground_truth)\}")
VerdictParser = Callable[[str], Any]


def render(template: str, prompt: str, response: str, ground_truth: Any) -> str:
    """`template` with {prompt}, {response} and {ground_truth} replaced in one pass (a response that spells
    "{ground_truth}" stays that text: the policy cannot make the judge see the reference twice)."""
    values = {"prompt": prompt, "response": response, "ground_truth": "" if ground_truth is None else str(ground_truth)}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def build_parser(verdict_regex: str, verdict_fn: str | None = None) -> VerdictParser:
    """`verdict_fn` ("file.py:function", text → float | None) when set, else the first match of `verdict_regex`'s one
    group, read as a float (None when there is no match or it is not a number)."""
    if verdict_fn is not None:
        path, name = verdict_fn.rsplit(":", 1)
        return import_function(path, name)
    pattern = re.compile(verdict_regex)

    def parse(text: str) -> float | None:
        match = pattern.search(text)
        try:
            return None if match is None else float(match.group(1))
        except (TypeError, ValueError):
            return None

    return parse


@dataclass
class Verdicts:
    """One judging call, per row ([B])."""

    scores: np.ndarray  # float64; fallback_score where status != "ok"
    status: np.ndarray  # "ok" | "unparsed" | "error"
    texts: list[str]  # the judge's generated text ("" for a row not judged)

    def metrics(self) -> dict[str, float]:
        return {"reward/judge_unparsed": float((self.status == UNPARSED).sum()),
                "reward/judge_errors": float((self.status == ERROR).sum())}


def read_verdicts(texts: Sequence[str], parse: VerdictParser, fallback: float, status: np.ndarray) -> Verdicts:
    """Parse each text whose row is still "ok"; a missing, non-numeric or non-finite verdict is unparsed, a parser
    that raises is an error (logged once per call)."""
    scores = np.full(len(texts), float(fallback))
    status = status.copy()
    first_error: str | None = None
    for i, text in enumerate(texts):
        if status[i] != OK:
            continue
        try:
            value = parse(text)
        except Exception as err:  # user code: the row scores the fallback and is counted, training goes on
            status[i] = ERROR
            first_error = first_error or f"{type(err).__name__}: {err} (verdict text {text!r})"
            continue
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
            scores[i] = float(value)
        else:
            status[i] = UNPARSED
    if first_error is not None:
        logger.warning("judge verdict parser raised on %d row(s), scored reward.judge.fallback_score=%s; first: %s",
                       int((status == ERROR).sum()), fallback, first_error)
    return Verdicts(scores, status, list(texts))


class JudgeFn(Protocol):
    """What the reward manager calls for the `judge` source: (prompts, responses, ground truths) → `Verdicts`."""

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], ground_truths: Sequence[Any]) -> Verdicts:
        ...

    def close(self) -> None:
        ...
