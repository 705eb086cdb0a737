"""`tool_calculator`: the built-in task that needs a tool — multiply a 3-digit by a 2-digit number (5-digit products).

A ~1M-parameter character model cannot multiply, but it can copy: call the `calculator` tool with the question's
expression in the Hermes / Qwen format, read the tool response, copy the number after "####". Rows carry the
demonstration as `messages` (user question, assistant call, tool response as a `user` turn, assistant answer), so
the SFT dataset trains on the assistant turns only and keeps the tool response as masked context. The tool
responses of flawed calls come from the parser and calculator the rollout uses (`agentic/`), and the turns are laid
out as the `hermes_plain` format appends them to a trajectory, so the SFT tokens are the tokens a rollout builds
(tests/data/test_tool_task.py checks this against a real `ToolSession`).

`sft.label_noise` replaces that share of the demonstrations by a flawed one, the three kinds in equal parts:
`no_call` (answers a near-miss guess without calling), `malformed` (broken JSON or an unclosed tag, reads the
error, then guesses) and `wrong_expression` (a well-formed call with an operand digit wrong, copies its wrong
result). RL with the exact-answer reward then has calls to add, to repair and to correct.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable

from hybridflow.agentic.formats import HermesPlainFormat
from hybridflow.agentic.tools import CalculatorTool, ToolContext
from hybridflow.protocol import keys

TOOL = "calculator"
FLAWED_KINDS = ("no_call", "malformed", "wrong_expression")
_FORMAT = HermesPlainFormat()
_TOOLS = {TOOL: CalculatorTool()}


def operands(question: str) -> tuple[int, int]:
    """(a, b) of "What is a*b?"."""
    a, b = question.removeprefix("What is ").removesuffix("?").split("*")
    return int(a), int(b)


def space() -> Iterable[tuple[str, str]]:
    """(question, answer) for every a in 100..999, b in 10..99 whose product has five digits: 66,471 problems.
    Decision: every copy (operands into the call, the result into the answer) is then at one fixed distance, which a
    model this small learns in a few hundred SFT steps; with 4- and 5-digit results the result's copy was still ~60%
    right per digit after 1,200 steps while the fixed-distance operand copy was learnt."""
    for a in range(100, 1000):
        for b in range(10, 100):
            if a * b >= 10_000:
                yield f"What is {a}*{b}?", str(a * b)


def call_text(expression: str, name: str = TOOL) -> str:
    """One Hermes tool call, compact JSON (fewer tokens for a character model; any JSON parses the same)."""
    body = json.dumps({"name": name, "arguments": {"expression": expression}}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


def tool_responses(turn_text: str) -> str:
    """The tool turn a rollout appends after `turn_text` (between `hermes_plain`'s "User: " and "\\nAssistant:"):
    what `agentic.session.ToolSession` answers for each call — the parser's error for a malformed call, an unknown
    tool's error, else the calculator's result. Empty when the turn has no calls (the trajectory ends)."""
    texts = []
    for call in _FORMAT.parse(turn_text):
        if call.error is not None:
            texts.append(f"Error: {call.error}")
        elif call.name not in _TOOLS:
            texts.append(f"Error: unknown tool {call.name!r}; available: {', '.join(_TOOLS)}")
        else:
            texts.append(_TOOLS[call.name].execute(call.arguments, ToolContext("demo")).text)
    return "".join(f"<tool_response>{t}</tool_response>" for t in texts)


def near_miss(answer: str, rng: random.Random) -> str:
    """`answer` with one digit changed (the leading digit stays non-zero): a plausible wrong guess."""
    digits = list(answer)
    i = rng.randrange(len(digits))
    choices = [d for d in "0123456789" if d != digits[i] and (i > 0 or d != "0")]
    digits[i] = rng.choice(choices)
    return "".join(digits)


def _wrong_expression(a: int, b: int, rng: random.Random) -> str:
    """A well-formed but wrong expression: one operand with a digit changed, its product still of five digits."""
    while True:
        x, y = (int(near_miss(str(a), rng)), b) if rng.random() < 0.5 else (a, int(near_miss(str(b), rng)))
        if 10_000 <= x * y <= 99_999:
            return f"{x}*{y}"


def _malformed_call(a: int, b: int, rng: random.Random) -> str:
    good = call_text(f"{a}*{b}")
    if rng.random() < 0.5:
        return good.replace("}}</tool_call>", "}</tool_call>")  # a missing brace: not valid JSON
    return good.removesuffix("</tool_call>")  # an unclosed tag


def demonstration(question: str, answer: str, kind: str, rng: random.Random) -> list[dict[str, str]]:
    """The conversation of one demonstration of `kind` (clean or one of FLAWED_KINDS)."""
    a, b = operands(question)
    user = {"role": "user", "content": question}
    if kind == "no_call":
        return [user, {"role": "assistant", "content": f"#### {near_miss(answer, rng)}"}]
    if kind == "clean":
        call = call_text(f"{a}*{b}")
    elif kind == "malformed":
        call = _malformed_call(a, b, rng)
    elif kind == "wrong_expression":
        call = call_text(_wrong_expression(a, b, rng))
    else:
        raise ValueError(f"demonstration kind {kind!r}: expected clean or one of {', '.join(FLAWED_KINDS)}")
    # A clean call's response is the product (`answer`); the others go through the parser and the calculator.
    response = f"<tool_response>{answer}</tool_response>" if kind == "clean" else tool_responses(call)
    result = response.removeprefix("<tool_response>").removesuffix("</tool_response>")
    final = result if kind != "malformed" else near_miss(answer, rng)  # after an error the demonstrator guesses
    return [user, {"role": "assistant", "content": call}, {"role": "user", "content": response},
            {"role": "assistant", "content": f"#### {final}"}]


def flawed(row: dict, rng: random.Random) -> dict:
    """`row` with its demonstration replaced by a flawed one (a kind drawn uniformly from FLAWED_KINDS)."""
    kind = rng.choice(FLAWED_KINDS)
    question, answer = row["prompt"][0]["content"], str(row[keys.REWARD_MODEL]["ground_truth"])
    return {**row, "messages": demonstration(question, answer, kind, rng),
            keys.EXTRA_INFO: {**row[keys.EXTRA_INFO], "demonstration": kind}}
