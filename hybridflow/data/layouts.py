"""Which columns each command reads, decided from a file's column names alone (so `config validate` can check a
parquet's schema without reading its rows, and a dataset fails on a wrong layout with the accepted ones listed).

SFT layouts (verl's and TRL's): `messages` (a conversation; every assistant turn is trained), prompt +
`response` (verl), prompt + `completion` (TRL's prompt-completion; text or messages), `text` (TRL's language
modelling: every token is trained). RL (`train`): the prompt column (`data.prompt_key`) and, when reward functions
score the rows, `reward_model`. Preference data (rm, dpo): `preference_columns.resolve_columns`.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridflow.data.preference_columns import PROMPT_ALIASES
from hybridflow.protocol import keys

SFT_LAYOUTS = ("messages", "prompt+response", "prompt+completion", "text")
_SFT_HELP = ("SFT reads one of these layouts: `messages` (chat conversations), `prompt` + `response` (verl), "
             "`prompt` + `completion` (TRL), or `text` (TRL language modelling); the prompt column is "
             "data.prompt_key")


def sft_layout(columns: Sequence[str], prompt_key: str = "prompt", name: str = "sft") -> str:
    """The SFT layout of a file with `columns` (one of SFT_LAYOUTS); ValueError listing the accepted ones."""
    cols = list(columns)
    if "messages" in cols:
        return "messages"
    if prompt_key in cols:
        for response in ("response", "completion"):
            if response in cols:
                return f"prompt+{response}"
    if "text" in cols:
        return "text"
    found = f"Columns found: {cols}."
    if prompt_key in cols:
        raise ValueError(f"{name} data: prompt column {prompt_key!r} but no 'response' or 'completion' column. "
                         f"{found} {_SFT_HELP}")
    alias = [c for c in PROMPT_ALIASES if c in cols and c != prompt_key]
    hint = f"; the prompt looks like column {alias[0]!r}: set data.prompt_key={alias[0]}" if alias else ""
    raise ValueError(f"{name} data: no known SFT layout. {found} {_SFT_HELP}{hint}")


def rl_columns_problem(columns: Sequence[str], prompt_key: str, needs_ground_truth: bool) -> str | None:
    """Why RL prompts cannot be read from a file with `columns` (None when they can)."""
    cols = list(columns)
    problems = []
    if prompt_key not in cols:
        alias = [c for c in PROMPT_ALIASES if c in cols]
        hint = (f"set data.prompt_key={alias[0]} (or rename the column)" if alias else
                f"name the prompt column with data.prompt_key (verl's is 'prompt'; also {', '.join(PROMPT_ALIASES[1:])})")
        problems.append(f"no prompt column {prompt_key!r}: {hint}")
    if needs_ground_truth and keys.REWARD_MODEL not in cols:
        problems.append("no 'reward_model' column (verl's {style, ground_truth}) for the reward functions: add it, "
                        "or set data.allow_missing_ground_truth=true when the reward ignores ground truth")
    if not problems:
        return None
    return "; ".join(problems) + f". Columns found: {cols}"
