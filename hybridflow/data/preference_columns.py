"""Which columns of a preference file hold the prompt, the chosen and the rejected response, and how a row's cells
become (prompt messages or text, chosen text, rejected text) — the layouts users bring from TRL, verl and OpenRLHF.

Columns: `data.prompt_key` / `data.chosen_key` / `data.rejected_key` (verl's and OpenRLHF's names, defaults
prompt / chosen / rejected). While a key is at its default and the file lacks that column, the first present alias
is used (`PROMPT_ALIASES`, ...: e.g. stack-exchange-paired's question / response_j / response_k). No prompt column
at all is TRL's "implicit prompt" layout (and OpenRLHF's default `--prompt_key None`).

Rows (TRL's preference formats):
- standard: prompt text, chosen / rejected texts;
- conversational: prompt messages, chosen / rejected each a list ending in the assistant's message — optionally
  repeating the prompt's turns first (UltraFeedback-binarized style), which must then equal the prompt;
- implicit prompt, conversational: chosen / rejected full conversations; the prompt is their shared leading turns;
- implicit prompt, text (Anthropic HH style): chosen / rejected full texts; the pair's shared token prefix is the
  prompt (as for every pair, `split_pair`).

A pair that cannot teach a preference raises a `MalformedRow` whose `reason` names it: `null_response` (chosen or
rejected is null), `empty_response` (chosen empty or whitespace only; an empty rejected response stays a valid
pair, "answer rather than say nothing", except as an implicit text prompt's carrier), `identical_pair` (chosen ==
rejected), else `malformed`; the dataset skips and counts them, or raises with `data.strict` (`preference_dataset.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from hybridflow.data.templates import MalformedRow, Messages, to_messages

PROMPT_ALIASES = ("prompt", "question", "instruction", "query", "input")
CHOSEN_ALIASES = ("chosen", "chosen_response", "response_chosen", "response_j", "positive")
REJECTED_ALIASES = ("rejected", "rejected_response", "response_rejected", "response_k", "negative")
DEFAULTS = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}


class NullResponse(MalformedRow):
    reason: ClassVar[str] = "null_response"


class EmptyResponse(MalformedRow):
    reason: ClassVar[str] = "empty_response"


class IdenticalPair(MalformedRow):
    reason: ClassVar[str] = "identical_pair"


def skip_reason(err: MalformedRow) -> str:
    """The `SkipReport` reason of a row that raised `err`."""
    return getattr(err, "reason", "malformed")


@dataclass(frozen=True)
class PreferenceColumns:
    prompt: str | None  # None: the implicit-prompt layout
    chosen: str
    rejected: str


def _pick(role: str, key: str, aliases: Sequence[str], columns: Sequence[str]) -> str | None:
    if key in columns:
        return key
    if key == DEFAULTS[role]:
        return next((a for a in aliases if a in columns), None)
    return None


def resolve_columns(columns: Sequence[str], prompt_key: str = "prompt", chosen_key: str = "chosen",
                    rejected_key: str = "rejected", name: str = "preference") -> PreferenceColumns:
    """The columns of a file with `columns`; raises ValueError naming the columns found and the ones expected."""
    columns = list(columns)
    chosen = _pick("chosen", chosen_key, CHOSEN_ALIASES, columns)
    rejected = _pick("rejected", rejected_key, REJECTED_ALIASES, columns)
    prompt = _pick("prompt", prompt_key, PROMPT_ALIASES, columns)
    problems = []
    for role, key, found, aliases in (("chosen", chosen_key, chosen, CHOSEN_ALIASES),
                                      ("rejected", rejected_key, rejected, REJECTED_ALIASES)):
        if found is None:
            also = f" (or one of {', '.join(aliases[1:])})" if key == DEFAULTS[role] else ""
            problems.append(f"no {role} column {key!r}{also}")
    if prompt is None and prompt_key != DEFAULTS["prompt"]:
        problems.append(f"no prompt column {prompt_key!r}")
    if problems:
        accepted = "; ".join(f"{role}: {', '.join(aliases)}" for role, aliases in (
            ("prompt", PROMPT_ALIASES), ("chosen", CHOSEN_ALIASES), ("rejected", REJECTED_ALIASES)))
        raise ValueError(
            f"{name} data: {'; '.join(problems)}. Columns found: {columns}. Accepted columns ({accepted}): "
            "prompt/chosen/rejected (TRL, verl, OpenRLHF), or chosen/rejected alone with the prompt inside them; "
            "name yours with data.prompt_key=..., data.chosen_key=..., data.rejected_key=...")
    return PreferenceColumns(prompt, chosen, rejected)


def _messages(value: Any, column: str) -> Messages | None:
    """A cell that is a message list → its messages; a string → None."""
    if isinstance(value, str):
        return None
    if value is None:
        raise NullResponse(f"{column} is null")
    try:
        return to_messages(value)
    except MalformedRow as err:
        raise MalformedRow(f"{column} must be a string or a list of chat messages ({err})") from err


def _response(messages: Messages, prompt: Messages, column: str) -> str:
    """The assistant's message after the prompt's turns (repeated at the front or not)."""
    head, last = messages[:-1], messages[-1]
    if head and head != prompt:
        raise MalformedRow(f"{column} repeats {len(head)} leading messages that differ from the prompt's "
                           f"{len(prompt)}; give only the response, or the prompt's exact turns before it")
    return last["content"]


def split_row(row: dict[str, Any], cols: PreferenceColumns) -> tuple[Messages | None, str, str]:
    """(prompt messages — None when the prompt is the text pair's shared prefix —, chosen text, rejected text);
    raises a `MalformedRow` (with its `reason`, see the module docstring) for a pair that cannot be trained on."""
    prompt, chosen, rejected = _split(row, cols)
    # An empty rejected response is a real preference (answer rather than stop: what a policy's empty samples are
    # rejected for), unless it would have to carry the implicit text prompt.
    for column, text in (("chosen", chosen), ("rejected", rejected)):
        if not text.strip() and (column == "chosen" or prompt is None):
            raise EmptyResponse(f"{column} is {'empty' if not text else 'whitespace only'}"
                                + ("" if prompt is not None else " (without a prompt column it must hold the prompt)"))
    if chosen == rejected:
        raise IdenticalPair(f"chosen and rejected are the same text ({_short(chosen)}): nothing to prefer")
    return prompt, chosen, rejected


def _short(text: str, width: int = 40) -> str:
    return repr(text if len(text) <= width else text[:width] + "...")


def _split(row: dict[str, Any], cols: PreferenceColumns) -> tuple[Messages | None, str, str]:
    chosen, rejected = row.get(cols.chosen), row.get(cols.rejected)
    c_msgs, r_msgs = _messages(chosen, "chosen"), _messages(rejected, "rejected")
    if cols.prompt is not None:  # each side a text, or messages ending in the response
        prompt = to_messages(row.get(cols.prompt))
        return (prompt, chosen if c_msgs is None else _response(c_msgs, prompt, "chosen"),
                rejected if r_msgs is None else _response(r_msgs, prompt, "rejected"))
    if (c_msgs is None) != (r_msgs is None):
        raise MalformedRow("without a prompt column, chosen and rejected must both be texts or both be message lists")
    if c_msgs is None:  # implicit text prompt: the shared token prefix is cut off when the pair is collated
        return None, chosen, rejected
    if c_msgs == r_msgs:
        raise IdenticalPair(f"chosen and rejected are the same {len(c_msgs)} messages: nothing to prefer")
    shared = 0
    while shared < min(len(c_msgs), len(r_msgs)) - 1 and c_msgs[shared] == r_msgs[shared]:
        shared += 1
    if shared == 0 or len(c_msgs) != shared + 1 or len(r_msgs) != shared + 1:
        raise MalformedRow(f"without a prompt column, chosen ({len(c_msgs)} messages) and rejected "
                           f"({len(r_msgs)}) must share their leading turns and differ only in the last message")
    prompt = c_msgs[:shared]
    return prompt, _response(c_msgs, prompt, "chosen"), _response(r_msgs, prompt, "rejected")
