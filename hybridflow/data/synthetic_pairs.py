"""Synthetic preference pairs from a built-in task: chosen = the correct answer, rejected = a wrong one.

The preference ("prefer correct answers") is checkable: the task's rule scorer is the ground truth, so an RM
trained on these pairs can drive PPO and the rule metric measures whether that helped. Each task has kinds of
wrong answers, mixed by `mix` weights:
  arithmetic — `near` (±1, ±2, ±10: carry and last-digit slips), `random` (any other number), `format` (the
               right number without the `####` marker, which the scorer rejects);
  sort       — `unsorted` (the right digits out of order), `wrong_digits` (sorted, one digit changed).

`sampled_preference_rows` builds pairs the way RLHF collects comparisons (InstructGPT): rejected = a response
SAMPLED from the policy to be trained (the SFT model) that the labeler — here the task's rule scorer — marks
wrong (`rejected_kind` "sampled"). Hand-made wrong answers miss what the policy actually gets wrong: on `sort`
the tiny SFT model's errors are ~80% sorted answers with a wrong digit, and an RM trained on the synthetic mix
ranked its own samples at chance (AUC 0.51) while one trained on its samples reached AUC 0.88.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hybridflow.protocol import keys
from hybridflow.rewards.registry import select_reward_fn

NEAR_MISSES = (-10, -2, -1, 1, 2, 10)


def _int_answer(truth: str, rng: random.Random, kind: str) -> str:
    value = int(truth)
    while True:
        candidate = value + rng.choice(NEAR_MISSES) if kind == "near" else rng.randint(0, 2 * value + 20)
        if candidate != value and candidate >= 0:
            return f"#### {candidate}"


def _arithmetic(truth: str, rng: random.Random, kind: str) -> str:
    if kind == "format":
        return truth
    return _int_answer(truth, rng, kind)


def _sort(truth: str, rng: random.Random, kind: str) -> str:
    digits = truth.split()
    if kind == "unsorted" and len(set(digits)) > 1:
        shuffled = list(digits)
        while shuffled == digits:
            rng.shuffle(shuffled)
        return "#### " + " ".join(shuffled)
    changed = list(digits)
    i = rng.randrange(len(changed))
    changed[i] = str((int(changed[i]) + rng.randint(1, 9)) % 10)
    return "#### " + " ".join(sorted(changed))


TASK_WRONG: dict[str, tuple[Callable[[str, random.Random, str], str], dict[str, float]]] = {
    "hybridflow/arithmetic": (_arithmetic, {"near": 0.4, "random": 0.4, "format": 0.2}),
    "hybridflow/sort": (_sort, {"unsorted": 0.5, "wrong_digits": 0.5}),
}


def _rule_correct(row: Mapping[str, Any], response: str) -> bool:
    fn = select_reward_fn(row[keys.DATA_SOURCE])
    out = fn(row[keys.DATA_SOURCE], response, row[keys.REWARD_MODEL]["ground_truth"], row.get(keys.EXTRA_INFO))
    if isinstance(out, Mapping):
        return float(out.get("acc", out.get("score", 0.0))) >= 1.0
    return float(out) >= 1.0


def sampled_preference_rows(task_rows: Sequence[dict[str, Any]], samples: Sequence[Sequence[str]], seed: int,
                            is_correct: Callable[[Mapping[str, Any], str], bool] | None = None,
                            max_pairs_per_prompt: int = 1,
                            fallback_mix: Mapping[str, float] | None = None) -> list[dict[str, Any]]:
    """Pairs from policy samples: for task row i, `samples[i]` are responses generated for its prompt; each
    (deduplicated) wrong one is a rejected candidate, chosen = the reference answer (`response`). Up to
    `max_pairs_per_prompt` pairs per prompt; a prompt whose samples are all correct gets a synthetic wrong answer
    (`fallback_mix` kinds, as `preference_rows`) when `fallback_mix` is given, else no pair.
    `is_correct(row, response)` defaults to the task's rule scorer (exact answer). Deterministic in `seed`."""
    if len(samples) != len(task_rows):
        raise ValueError(f"{len(samples)} sample lists for {len(task_rows)} task rows; give one list per row")
    check = is_correct or _rule_correct
    rng = random.Random(seed)
    out = []
    for row, responses in zip(task_rows, samples):
        wrong = sorted({r for r in responses if r != row["response"] and not check(row, r)})
        rng.shuffle(wrong)
        if wrong:
            out += [{**row, "chosen": row["response"], "rejected": r, "rejected_kind": "sampled"}
                    for r in wrong[:max_pairs_per_prompt]]
        elif fallback_mix is not None:
            out += preference_rows([row], rng.randrange(2**31), fallback_mix or None)
    return out


def preference_rows(task_rows: Sequence[dict[str, Any]], seed: int,
                    mix: Mapping[str, float] | None = None) -> list[dict[str, Any]]:
    """Task rows (`prompt`, `response` = "#### <answer>", `data_source`, `reward_model.ground_truth`) → rows with
    `prompt`, `chosen`, `rejected`, `rejected_kind` (and the task's other columns). Deterministic in `seed`."""
    rng = random.Random(seed)
    out = []
    for row in task_rows:
        source = row.get(keys.DATA_SOURCE)
        if source not in TASK_WRONG:
            raise ValueError(f"no synthetic preference pairs for data_source {source!r}; built-in tasks with pairs: "
                             f"{', '.join(TASK_WRONG)} (or give prompt/chosen/rejected parquet in data.train_files)")
        wrong, default_mix = TASK_WRONG[source]
        weights = dict(mix or default_mix)
        unknown = set(weights) - set(default_mix)
        if unknown:
            raise ValueError(f"unknown rejected kinds {sorted(unknown)} for {source}; choose from {sorted(default_mix)}")
        kind = rng.choices(list(weights), weights=list(weights.values()))[0]
        truth = str(row[keys.REWARD_MODEL]["ground_truth"])
        out.append({**row, "chosen": row["response"], "rejected": wrong(truth, rng, kind), "rejected_kind": kind})
    return out
