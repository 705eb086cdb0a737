"""Preference pairs are checked when the file is loaded, not when their batch is built: identical, empty-chosen and
null pairs are skipped and counted by reason with their row indices (or, with `data.strict`, are an error naming
the row); an empty rejected answer stays a valid pair; a pair's batch still names its row when its tokens clash."""

from __future__ import annotations

import pytest

from hybridflow.data.preference_dataset import PreferenceDataset
from hybridflow.models.tokenizer import builtin_tokenizer
from hybridflow.workers.supervised_batch import collate_pairs

TOK = builtin_tokenizer()
GOOD = {"prompt": "2+3?", "chosen": "5", "rejected": "6"}
SAID = {"role": "assistant", "content": "5"}


def _rows() -> list[dict]:
    return [GOOD,
            {"prompt": "2+2?", "chosen": "4", "rejected": "4"},  # 1: identical
            {"prompt": "1+1?", "chosen": "", "rejected": "3"},  # 2: empty chosen
            {"prompt": "1+2?", "chosen": None, "rejected": "4"},  # 3: null chosen
            {"prompt": "3+3?", "chosen": "  ", "rejected": "7"},  # 4: whitespace-only chosen
            {"prompt": "3+4?", "chosen": [SAID], "rejected": [SAID]},  # 5: identical messages
            {"prompt": "3+5?", "chosen": "8", "rejected": None},  # 6: null rejected
            {"prompt": None, "chosen": "8", "rejected": "9"},  # 7: malformed (no prompt)
            {"prompt": "4+4?", "chosen": "8", "rejected": ""}]  # 8: kept: "answer rather than say nothing"


def test_unusable_pairs_are_skipped_and_counted_with_their_rows() -> None:
    ds = PreferenceDataset(_rows(), TOK, max_length=64, name="dpo-train")
    assert len(ds) == 2 and [ds[i]["index"] for i in range(2)] == [0, 8]  # items keep their file row
    assert ds.skips.to_dict() == {
        "rows_read": 9, "skipped": 7,
        "reasons": {"identical_pair": 2, "empty_response": 2, "null_response": 2, "malformed": 1},
        "example_rows": {"identical_pair": [1, 5], "empty_response": [2, 4], "null_response": [3, 6],
                         "malformed": [7]}}
    collate_pairs([ds[0], ds[1]], TOK.pad_token_id, score_slot=False)  # every kept pair builds a batch


@pytest.mark.parametrize("row,reason", [(1, "identical_pair"), (2, "empty_response"), (3, "null_response")])
def test_strict_names_the_row_reason_and_switch(row: int, reason: str) -> None:
    rows = [GOOD, _rows()[row]]
    with pytest.raises(ValueError, match=rf"dpo-train data row 1 cannot be trained on \({reason}\).*data\.strict=false"):
        PreferenceDataset(rows, TOK, max_length=64, name="dpo-train", strict=True)


def test_implicit_text_prompt_needs_both_sides() -> None:  # without a prompt column an empty side has no prompt
    ds = PreferenceDataset([{"chosen": "User: hi\nAssistant: yo", "rejected": ""},
                            {"chosen": "User: hi\nAssistant: yo", "rejected": "User: hi\nAssistant: no"}], TOK,
                           max_length=64)
    assert ds.skips.counts == {"empty_response": 1} and len(ds) == 1


def test_only_unusable_rows_is_an_error_with_the_summary() -> None:
    with pytest.raises(ValueError, match=r"dpo-val dataset is empty after validation.*1 identical_pair \(rows \[0\]\)"):
        PreferenceDataset([_rows()[1]], TOK, max_length=64, name="dpo-val")


def test_a_token_clash_in_a_batch_names_the_row() -> None:  # texts differ, tokens are cut to the same tail
    ds = PreferenceDataset([{"prompt": "q", "chosen": "a" + "x" * 40, "rejected": "b" + "x" * 40}], TOK,
                           max_length=8)
    with pytest.raises(ValueError, match="preference row 0: chosen and rejected are identical tokens"):
        collate_pairs([ds[0]], TOK.pad_token_id)
