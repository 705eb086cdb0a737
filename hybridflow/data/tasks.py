"""Built-in synthetic tasks, generated on the fly (quickstart and tests; no files needed).

Each task enumerates its whole problem space, shuffles it with `seed`, takes validation from the front and
training from the rest (so the splits are disjoint; training repeats problems only when asked for more than
remain). Problems are tiny on purpose — a ~1M-parameter character model must learn them in minutes on a CPU.
Rows follow verl's schema and also carry the SFT warm start's demonstration: `response` (the correct answer), or
`messages` for a task whose demonstration is a conversation (`tool_calculator`: a tool call, the tool's response,
the answer; `data/tool_task.py`). Answers come after `####`, as in GSM8K; the scorers are
`hybridflow.rewards.synthetic` and `hybridflow.rewards.tool_task`. `colour_count` is the vision-language task (rows
carry `images`; `data/colour_task.py`, model.preset=tiny-vl).
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hybridflow.data import colour_task, tool_task
from hybridflow.protocol import keys

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # ground truth, without the "#### " prefix
    image: str | None = None  # vision tasks: what `Task.draw` turns into the row's one image


@dataclass(frozen=True)
class Task:
    name: str
    ability: str
    space: Callable[[], Iterable[Problem]]  # every problem, in a fixed order
    # The demonstration as a conversation (SFT `messages`); None = `response` "#### <answer>".
    demonstrate: Callable[[Problem], list[dict[str, str]]] | None = None
    # `sft.label_noise`: a training row → a flawed demonstration of it; None = the answer one too high.
    corrupt: Callable[[dict[str, Any], random.Random], dict[str, Any]] | None = None
    draw: Callable[[str], bytes] | None = None  # vision tasks: `Problem.image` → image bytes (PNG)

    @property
    def data_source(self) -> str:
        return f"hybridflow/{self.name}"


def _arithmetic() -> Iterable[Problem]:
    for a, b in itertools.product(range(100), range(100)):
        yield Problem(f"What is {a:02d}+{b:02d}?", str(a + b))


def _sort() -> Iterable[Problem]:
    for digits in itertools.product(range(10), repeat=4):
        yield Problem(f"Sort {' '.join(map(str, digits))}.", " ".join(map(str, sorted(digits))))


def _tool_multiplication() -> Iterable[Problem]:
    return (Problem(question, answer) for question, answer in tool_task.space())


def _colour_count() -> Iterable[Problem]:
    return (Problem(question, answer, layout) for question, answer, layout in colour_task.space())


def _tool_demonstration(problem: Problem) -> list[dict[str, str]]:
    return tool_task.demonstration(problem.question, problem.answer, "clean", random.Random(0))


TASKS: dict[str, Task] = {
    "arithmetic": Task("arithmetic", "arithmetic", _arithmetic),  # 2-digit addition, 10,000 problems
    "sort": Task("sort", "sorting", _sort),  # sort 4 digits, 10,000 problems
    # 3-digit x 2-digit multiplication (5-digit products) through the calculator tool (multi-turn rollouts), 66,471 problems
    "tool_calculator": Task("tool_calculator", "tool use", _tool_multiplication, _tool_demonstration,
                            tool_task.flawed),
    # count the squares of one colour in a 4x4-grid image (vision-language models), 20,000 problems
    "colour_count": Task("colour_count", "visual counting", _colour_count, corrupt=colour_task.flawed,
                         draw=colour_task.draw),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"data.task={name!r} is not a built-in task; choose one of {', '.join(TASKS)} "
                         "or give parquet files in data.train_files")
    return TASKS[name]


def _row(task: Task, problem: Problem, split: str, index: int) -> dict[str, Any]:
    row = {
        keys.DATA_SOURCE: task.data_source,
        "prompt": [{"role": "user", "content": problem.question}],
        "ability": task.ability,
        keys.REWARD_MODEL: {"style": "rule", "ground_truth": problem.answer},
        keys.EXTRA_INFO: {"split": split, "index": index},
    }
    if task.draw is not None:
        row["images"] = [{"bytes": task.draw(problem.image)}]
    if task.demonstrate is not None:
        return row | {"messages": task.demonstrate(problem)}
    return row | {"response": f"#### {problem.answer}"}


def task_splits(name: str, train_size: int, val_size: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(train_rows, val_rows) of a built-in task: deterministic in `seed`, disjoint problems."""
    task = get_task(name)
    problems = list(task.space())
    if val_size >= len(problems):
        raise ValueError(f"data.val_size={val_size} leaves no training problems for task {name!r} "
                         f"({len(problems)} problems in all); lower data.val_size")
    rng = random.Random(seed)
    rng.shuffle(problems)
    val, pool = problems[:val_size], problems[val_size:]
    if train_size <= len(pool):
        train = pool[:train_size]
    else:
        logger.info("task %s: data.train_size=%d > %d distinct training problems; repeating problems",
                    name, train_size, len(pool))
        train = pool + [rng.choice(pool) for _ in range(train_size - len(pool))]
    return ([_row(task, p, "train", i) for i, p in enumerate(train)],
            [_row(task, p, "val", i) for i, p in enumerate(val)])
