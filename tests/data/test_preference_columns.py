"""Preference data as users bring it: TRL's standard / conversational / implicit-prompt rows, verl's and OpenRLHF's
column keys and common aliases all become the same (prompt, chosen, rejected) pair; a file without usable columns
fails naming the columns it has and the ones expected."""

from __future__ import annotations

import pytest

from hybridflow.data.preference_columns import PreferenceColumns, resolve_columns, split_row
from hybridflow.data.preference_dataset import PreferenceDataset
from hybridflow.data.templates import MalformedRow
from hybridflow.models.tokenizer import builtin_tokenizer

TOK = builtin_tokenizer()
Q, GOOD, BAD = "What is 2+3?", "5", "6"
USER = {"role": "user", "content": Q}


def _said(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


LAYOUTS = {
    "trl standard": {"prompt": Q, "chosen": GOOD, "rejected": BAD},
    "trl conversational": {"prompt": [USER], "chosen": [_said(GOOD)], "rejected": [_said(BAD)]},
    "prompt repeated inside (ultrafeedback)": {"prompt": Q, "chosen": [USER, _said(GOOD)],
                                               "rejected": [USER, _said(BAD)]},
    "trl implicit prompt, conversational": {"chosen": [USER, _said(GOOD)], "rejected": [USER, _said(BAD)]},
    "stack-exchange-paired aliases": {"question": Q, "response_j": GOOD, "response_k": BAD},
    "chosen_response / rejected_response": {"prompt": Q, "chosen_response": GOOD, "rejected_response": BAD},
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_gives_the_same_pair(layout: str) -> None:
    reference = PreferenceDataset([LAYOUTS["trl standard"]], TOK, max_length=64)[0]
    got = PreferenceDataset([LAYOUTS[layout]], TOK, max_length=64)[0]
    assert got["chosen_input_ids"].tolist() == reference["chosen_input_ids"].tolist()
    assert got["rejected_input_ids"].tolist() == reference["rejected_input_ids"].tolist()


def test_configured_keys_win_over_aliases() -> None:  # verl data.chosen_key / OpenRLHF --chosen_key
    row = {"prompt": Q, "chosen": BAD, "rejected": GOOD, "better": GOOD, "worse": BAD}
    ds = PreferenceDataset([row], TOK, max_length=64, chosen_key="better", rejected_key="worse")
    ref = PreferenceDataset([LAYOUTS["trl standard"]], TOK, max_length=64)[0]
    assert ds[0]["chosen_input_ids"].tolist() == ref["chosen_input_ids"].tolist()
    assert ds.columns == PreferenceColumns("prompt", "better", "worse")


def test_implicit_text_prompt_is_the_shared_prefix() -> None:  # Anthropic HH: full conversations as text
    row = {"chosen": "User: What is 2+3?\nAssistant: 5", "rejected": "User: What is 2+3?\nAssistant: 6"}
    item = PreferenceDataset([row], TOK, max_length=64)[0]
    c, r = item["chosen_input_ids"].tolist(), item["rejected_input_ids"].tolist()
    assert c[:-2] == r[:-2] and c != r  # one shared prefix; they differ in the answer (then EOS)


def test_missing_columns_name_what_was_found_and_expected() -> None:
    with pytest.raises(ValueError, match=r"no chosen column 'chosen'.*no rejected column.*Columns found: "
                                         r"\['text', 'label'\].*data.chosen_key"):
        PreferenceDataset([{"text": "a", "label": 1}], TOK, max_length=64, name="dpo-train")
    with pytest.raises(ValueError, match=r"no chosen column 'better'\. Columns found"):  # a set key has no alias
        resolve_columns(["prompt", "chosen", "rejected"], chosen_key="better")
    with pytest.raises(ValueError, match="no prompt column 'instruction_text'"):
        resolve_columns(["chosen", "rejected"], prompt_key="instruction_text")


@pytest.mark.parametrize("row,reason", [
    ({"prompt": Q, "chosen": [{"role": "user", "content": "other"}, _said(GOOD)], "rejected": [_said(BAD)]},
     "differ from the prompt"),
    ({"chosen": "User: 2+3?\nAssistant: 5", "rejected": [USER, _said(BAD)]}, "both be texts or both"),
    ({"chosen": [USER, _said(GOOD)], "rejected": [{"role": "user", "content": "x"}, _said(BAD)]},
     "share their leading turns"),
])
def test_malformed_rows_say_why(row: dict, reason: str) -> None:
    cols = resolve_columns(list(row))
    with pytest.raises(MalformedRow, match=reason):
        split_row(row, cols)
