"""The RL data contract at load: a missing `reward_model` column or an unusable ground truth is an error naming the
column, row, value and fix (unless ground truth is not needed); empty prompts are skipped and counted per reason."""

from __future__ import annotations

import logging
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridflow.config import load_config
from hybridflow.data import RLHFDataset, build_rl_datasets, write_rows
from hybridflow.models.tokenizer import builtin_tokenizer

TOK = builtin_tokenizer()


def _row(content: str = "What is 2+2?", truth: object = "4", **extra: object) -> dict:
    row = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": content}], "ability": "math",
           "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"index": 0}}
    return row | extra


def _no_reward_column(tmp_path) -> str:
    path = tmp_path / "q.parquet"
    pq.write_table(pa.table({"prompt": ["1+1?", "2+3?"], "data_source": ["openai/gsm8k"] * 2}), path)
    return str(path)


def _data_cfg(files: str, *overrides: str):
    return load_config([], [f"data.train_files=[{files}]", *overrides])


def test_parquet_without_reward_column_fails_at_load_naming_the_column_and_the_fix(tmp_path):
    cfg = _data_cfg(_no_reward_column(tmp_path))
    with pytest.raises(ValueError, match=r"no 'reward_model' column.*all 2 rows.*data.allow_missing_ground_truth=true"):
        build_rl_datasets(cfg.data, TOK, cfg.reward)


def test_missing_ground_truth_is_fine_when_allowed_or_when_the_reward_model_is_the_only_source(tmp_path):
    files = _no_reward_column(tmp_path)
    allowed = _data_cfg(files, "data.allow_missing_ground_truth=true")
    train, _ = build_rl_datasets(allowed.data, TOK, allowed.reward)
    assert len(train) == 2 and train[0]["reward_model"]["ground_truth"] is None
    model_only = _data_cfg(files, "reward.sources=[{name: model, weight: 1.0}]")
    assert len(build_rl_datasets(model_only.data, TOK, model_only.reward)[0]) == 2
    mixed = _data_cfg(files, "reward.sources=[{name: model, weight: 1.0}, {name: rule, weight: 1.0}]")
    with pytest.raises(ValueError, match="no 'reward_model' column"):
        build_rl_datasets(mixed.data, TOK, mixed.reward)


@pytest.mark.parametrize("truth, why", [
    (None, "is null"), (math.nan, "is null"), ("", "is an empty string"), ("  ", "is an empty string"),
    (True, "is a bool"), ([], "is an empty list"), ({}, "is an empty dict"), (b"4", "has unsupported type bytes"),
])
def test_unusable_ground_truth_names_the_row_the_value_and_the_fix(truth, why):
    rows = [_row(), _row(), _row(truth=truth), _row(truth=truth)]
    with pytest.raises(ValueError, match=rf"ground_truth {why}.* in 2 of 4 rows \(first: row 2, value "
                                         rf".*allow_missing_ground_truth"):
        RLHFDataset(rows, TOK, max_prompt_length=64)
    assert len(RLHFDataset(rows, TOK, max_prompt_length=64, require_ground_truth=False)) == 4


def test_null_ground_truth_in_parquet_fails_and_int_ground_truth_passes_through(tmp_path, caplog):
    write_rows([_row(truth="4"), _row(truth=None)], tmp_path / "null.parquet")
    with pytest.raises(ValueError, match=r"ground_truth is null in 1 of 2 rows \(first: row 1, value None\)"):
        RLHFDataset.from_files(str(tmp_path / "null.parquet"), TOK, max_prompt_length=64)
    write_rows([_row(truth=7), _row(truth=12)], tmp_path / "int.parquet")
    ds = RLHFDataset.from_files(str(tmp_path / "int.parquet"), TOK, max_prompt_length=64)
    assert [ds[i]["reward_model"]["ground_truth"] for i in range(2)] == [7, 12]  # scorers compare str(7) == "7"
    for truth in (2.5, [1, 2], {"target": 3, "numbers": [1, 2]}):
        assert RLHFDataset([_row(truth=truth)], TOK, max_prompt_length=64)[0]["reward_model"]["ground_truth"] == truth
    with caplog.at_level(logging.WARNING):
        RLHFDataset([_row(truth=2.5), _row(truth=7.0)], TOK, max_prompt_length=64)
    assert "1 ground truths are whole floats (first: row 1)" in caplog.text


def test_empty_prompts_are_skipped_and_counted_by_reason(caplog):
    rows = [
        _row(),
        _row(prompt=[{"role": "user", "content": ""}]),  # empty content
        _row(prompt=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  "}]),
        _row(prompt=" "),  # whitespace string
        _row(prompt=[{"role": "user", "content": "ok"}], truth=None, reward_model="bad"),  # malformed
        _row("fine"),
    ]
    with caplog.at_level(logging.WARNING):
        ds = RLHFDataset(rows, TOK, max_prompt_length=64)
    assert [ds[i]["index"] for i in range(len(ds))] == [0, 5]
    assert ds.skips.counts == {"empty_prompt": 3, "malformed": 1}
    assert ds.skips.examples == {"empty_prompt": [1, 2, 3], "malformed": [4]}
    assert ds.skips.to_dict() == {"rows_read": 6, "skipped": 4, "reasons": {"empty_prompt": 3, "malformed": 1},
                                  "example_rows": {"empty_prompt": [1, 2, 3], "malformed": [4]}}
    assert "train data: skipped 4 of 6 rows: 3 empty_prompt (rows [1, 2, 3]); 1 malformed (rows [4])" in caplog.text
    assert "row 1: every message has empty content" in caplog.text


def test_zero_token_prompt_with_raw_template_is_skipped_as_empty():
    class Blind:  # a tokenizer that has no token for "?": a raw "?" prompt renders to 0 tokens
        chat_template = None
        pad_token_id = 0

        def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
            return {"input_ids": [ord(c) for c in text if c != "?"]}

        def apply_chat_template(self, messages: list, **kwargs: object) -> str:
            return builtin_tokenizer().apply_chat_template(messages, **kwargs)

    ds = RLHFDataset([_row("hi"), _row("?")], Blind(), max_prompt_length=64, chat_template="raw")
    assert len(ds) == 1 and ds.skips.counts == {"empty_prompt": 1} and ds.skips.examples == {"empty_prompt": [1]}
