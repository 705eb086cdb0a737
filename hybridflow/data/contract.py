"""The RL data contract, checked once at load so that nothing is lost silently during a run.

Ground truth (`reward_model.ground_truth`) is required whenever a reward *function* scores the rows (`rule`,
`custom` or a registered function): it must be a non-empty string, a finite number (scorers compare `str(x)`), a
non-empty list or a non-empty dict (countdown, code); null/NaN, bools, empty values and other types are a
`ValueError` naming the column, row, value and fix. It is not required when the reward model is the only source,
or with `data.allow_missing_ground_truth=true`. Rows that cannot be used (malformed, empty prompt, over-long) are
skipped and counted per reason in a `SkipReport`, which the trainer sends to `events.jsonl` and `data/skipped_rows`.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridflow.config.schema import DataConfig, RewardConfig

from hybridflow.protocol import keys

logger = logging.getLogger(__name__)

MODEL_SOURCE = "model"
EXAMPLES_PER_REASON = 5
_FIX = (f"Fix: give every row a {keys.REWARD_MODEL} = {{style: rule, ground_truth: <answer>}}, or set "
        "data.allow_missing_ground_truth=true when the reward does not use ground truth (a reward-model-only run "
        "needs nothing)")


@dataclass
class SkipReport:
    """Rows of one dataset left out at load, by reason (`malformed`, `empty_prompt`, `overlong`)."""

    name: str
    rows_read: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[int]] = field(default_factory=dict)  # reason → first row indices

    def add(self, reason: str, index: int) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < EXAMPLES_PER_REASON:
            shown.append(index)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        parts = [f"{n} {reason} (rows {self.examples[reason]}{' ...' if n > len(self.examples[reason]) else ''})"
                 for reason, n in sorted(self.counts.items())]
        return f"{self.name} data: skipped {self.total} of {self.rows_read} rows: " + "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"rows_read": self.rows_read, "skipped": self.total, "reasons": dict(self.counts),
                "example_rows": {k: list(v) for k, v in self.examples.items()}}


def ground_truth_required(data_cfg: DataConfig, reward_cfg: RewardConfig) -> bool:
    """Whether rows need a ground truth: a reward function scores them and the user did not opt out."""
    if getattr(data_cfg, "allow_missing_ground_truth", False):
        return False
    return any(source.name != MODEL_SOURCE for source in reward_cfg.sources)


def ground_truth_problem(value: Any) -> str | None:
    """Why `value` is not a usable ground truth (None when it is)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "is null"
    if isinstance(value, bool):
        return "is a bool (scorers compare text; write it as a string)"
    if isinstance(value, str):
        return None if value.strip() else "is an empty string"
    if isinstance(value, numbers.Real):
        return None if math.isfinite(float(value)) else "is not a finite number"
    if isinstance(value, (list, tuple, dict)) or hasattr(value, "tolist"):
        return None if len(value) else f"is an empty {type(value).__name__}"
    return f"has unsupported type {type(value).__name__} (use a string, number, list or dict)"


def check_ground_truths(raw_rows: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]], name: str) -> None:
    """Raise a ValueError when the reward column is absent or a kept row's ground truth is unusable."""
    if raw_rows and not any(keys.REWARD_MODEL in row for row in raw_rows):
        raise ValueError(f"{name} data has no {keys.REWARD_MODEL!r} column, so reward functions would get "
                         f"ground_truth=None for all {len(raw_rows)} rows. {_FIX}")
    bad = [(row["index"], row[keys.REWARD_MODEL]["ground_truth"]) for row in rows
           if ground_truth_problem(row[keys.REWARD_MODEL]["ground_truth"]) is not None]
    if bad:
        index, value = bad[0]
        raise ValueError(f"{name} data: {keys.REWARD_MODEL}.ground_truth {ground_truth_problem(value)} in "
                         f"{len(bad)} of {len(rows)} rows (first: row {index}, value {value!r}). {_FIX}")
    whole = [row["index"] for row in rows if isinstance(row[keys.REWARD_MODEL]["ground_truth"], float)
             and float(row[keys.REWARD_MODEL]["ground_truth"]).is_integer()]
    if whole:  # typically an int column that went through float64 (pandas with NaN)
        logger.warning("%s data: %d ground truths are whole floats (first: row %d); scorers compare text, so 7.0 "
                       "reads as '7.0', not '7'. Store them as ints or strings", name, len(whole), whole[0])


def empty_prompt_reason(messages: Sequence[dict[str, str]]) -> str | None:
    """Why a prompt carries no text for the model: every message empty, or a user message empty."""
    if all(not m["content"].strip() for m in messages):
        return "every message has empty content"
    empty_user = [j for j, m in enumerate(messages) if m["role"] == "user" and not m["content"].strip()]
    if empty_user:
        return f"user message {empty_user[0]} has empty content"
    return None


def skipped_rows_event(reports: Sequence[SkipReport]) -> tuple[str, dict[str, Any]]:
    """(message, data) of the one `data_skipped` event: total, then per dataset its counts, reasons and examples."""
    message = "; ".join(r.summary() for r in reports if r.total) or "no rows skipped"
    data: dict[str, Any] = {"skipped_rows": sum(r.total for r in reports)}
    data |= {r.name: r.to_dict() for r in reports}
    return message, data
