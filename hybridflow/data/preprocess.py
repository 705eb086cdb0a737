"""Turn local GSM8K / MATH files (jsonl, json or parquet) into verl-schema rows. Nothing is downloaded.

GSM8K rows have `question` and `answer` (whose last line is "#### <number>"); MATH rows have `problem` and
`solution` (with a final `\\boxed{}`), plus optional `level`/`type`. Output columns: data_source, prompt (one user
message with the instruction appended), ability, reward_model {style: rule, ground_truth}, extra_info.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridflow.data.parquet_io import read_rows
from hybridflow.protocol import keys
from hybridflow.rewards.math import last_boxed

logger = logging.getLogger(__name__)

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a local .jsonl / .json (list of objects) / .parquet file."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--input {str(p)!r} is not a file")
    if p.suffix == ".parquet":
        return read_rows(str(p))
    text = p.read_text()
    if p.suffix == ".json":
        data = json.loads(text)
        if not isinstance(data, list):
            raise ValueError(f"{p}: a .json input must hold a list of objects")
        return data
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def gsm8k_answer(solution: str) -> str | None:
    m = re.search(r"#### (\-?[0-9\.\,]+)", solution)
    return m.group(1).replace(",", "") if m else None


def gsm8k_row(rec: dict[str, Any], split: str, index: int) -> dict[str, Any] | None:
    question, answer = rec.get("question"), rec.get("answer")
    if not isinstance(question, str) or not isinstance(answer, str) or gsm8k_answer(answer) is None:
        return None
    return {
        keys.DATA_SOURCE: "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
        "ability": "math",
        keys.REWARD_MODEL: {"style": "rule", "ground_truth": gsm8k_answer(answer)},
        keys.EXTRA_INFO: {"split": split, "index": index, "question": question, "answer": answer},
    }


def math_row(rec: dict[str, Any], split: str, index: int) -> dict[str, Any] | None:
    problem, solution = rec.get("problem"), rec.get("solution")
    if not isinstance(problem, str) or not isinstance(solution, str) or last_boxed(solution) is None:
        return None
    return {
        keys.DATA_SOURCE: "DigitalLearningGmbH/MATH-lighteval",
        "prompt": [{"role": "user", "content": f"{problem} {MATH_INSTRUCTION}"}],
        "ability": "math",
        keys.REWARD_MODEL: {"style": "rule", "ground_truth": last_boxed(solution)},
        keys.EXTRA_INFO: {"split": split, "index": index, "level": str(rec.get("level", "")),
                       "type": str(rec.get("type", ""))},
    }


PREPARERS: dict[str, Callable[[dict[str, Any], str, int], dict[str, Any] | None]] = {
    "gsm8k": gsm8k_row,
    "math": math_row,
}


def prepare(dataset: str, records: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    """verl-schema rows; records without the needed fields are skipped and counted in a warning."""
    if dataset not in PREPARERS:
        raise ValueError(f"dataset {dataset!r}: choose one of {', '.join(PREPARERS)}")
    rows, skipped = [], []
    for i, rec in enumerate(records):
        row = PREPARERS[dataset](rec, split, i)
        if row is None:
            skipped.append(i)
        else:
            rows.append(row)
    if skipped:
        logger.warning("%s/%s: skipped %d records without the expected fields (first: %s)", dataset, split,
                       len(skipped), skipped[:10])
    return rows


def split_name(path: str | Path) -> str:
    """train / test / validation from a file name like `gsm8k_test.jsonl`; default train."""
    stem = Path(path).stem.lower()
    for name in ("test", "validation", "val", "train"):
        if name in stem:
            return name
    return "train"
