"""RLHFDataset on verl-schema parquet written here: column variants, truncation modes, bad rows, collation."""

from __future__ import annotations

import copy
import logging

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hybridflow.data import RLHFDataset, collate_rl, read_rows, write_rows
from hybridflow.data.templates import plain_template, render
from hybridflow.models.tokenizer import builtin_tokenizer

TOK = builtin_tokenizer()


def _row(content: str, **extra) -> dict:
    row = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": content}], "ability": "math",
           "reward_model": {"style": "rule", "ground_truth": "4"}, "extra_info": {"split": "train", "index": 0}}
    row.update(extra)
    return row


def _ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def _prompt_text(content: str) -> str:
    return f"User: {content}\nAssistant:"


def test_parquet_column_variants_roundtrip(tmp_path):
    rows = [
        _row("What is 2+2?"),
        {"data_source": "lighteval/MATH", "prompt": "plain string prompt", "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": "\\frac{1}{2}"}, "extra_info": {"split": "train", "index": 1}},
        _row("system too", prompt=[{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Hi?"}]),
    ]
    # Separate files: the string-prompt row and the message rows have different arrow types.
    write_rows([rows[0], rows[2]], tmp_path / "a.parquet")
    write_rows([rows[1]], tmp_path / "b.parquet")
    ds = RLHFDataset.from_files([str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")], TOK,
                                max_prompt_length=128)
    assert len(ds) == 3
    item = ds[0]
    assert item["input_ids"].tolist() == _ids(_prompt_text("What is 2+2?"))
    assert item["reward_model"]["ground_truth"] == "4" and item["data_source"] == "openai/gsm8k"
    assert item["raw_prompt"] == rows[0]["prompt"]
    assert ds[1]["input_ids"].tolist() == _ids("Be brief.\nUser: Hi?\nAssistant:")
    assert ds[2]["input_ids"].tolist() == _ids(_prompt_text("plain string prompt"))
    assert ds[2]["raw_prompt"] == "plain string prompt"
    assert ds[2]["reward_model"]["ground_truth"] == "\\frac{1}{2}"
    # a directory stands for its parquet files, in name order
    assert [r["data_source"] for r in read_rows(str(tmp_path))] == ["openai/gsm8k", "openai/gsm8k", "lighteval/MATH"]


def test_optional_columns_missing_and_custom_prompt_key(tmp_path):
    table = pa.table({"question": ["1+1?", "2+3?"], "data_source": ["x", "y"]})
    pq.write_table(table, tmp_path / "q.parquet")
    ds = RLHFDataset.from_files(str(tmp_path / "q.parquet"), TOK, max_prompt_length=64, prompt_key="question",
                                require_ground_truth=False)
    item = ds[1]
    assert item["input_ids"].tolist() == _ids(_prompt_text("2+3?"))
    assert item["reward_model"]["ground_truth"] is None and item["extra_info"] == {} and item["ability"] == ""
    assert item["index"] == 1 and item["uid"] == "train-1"


def test_numeric_and_list_ground_truths_survive_parquet(tmp_path):
    write_rows([_row("a", reward_model={"style": "rule", "ground_truth": 7})], tmp_path / "n.parquet")
    write_rows([_row("b", reward_model={"style": "rule", "ground_truth": [1, 2]})], tmp_path / "l.parquet")
    assert RLHFDataset.from_files(str(tmp_path / "n.parquet"), TOK, max_prompt_length=64)[0][
        "reward_model"]["ground_truth"] == 7
    assert RLHFDataset.from_files(str(tmp_path / "l.parquet"), TOK, max_prompt_length=64)[0][
        "reward_model"]["ground_truth"] == [1, 2]


def test_fsspec_urls(tmp_path):
    write_rows([_row("What is 2+2?")], tmp_path / "f.parquet")
    ds = RLHFDataset.from_files(f"file://{tmp_path}/f.parquet", TOK, max_prompt_length=64)
    assert len(ds) == 1
    with fsspec.open("memory://bucket/d.parquet", "wb") as f:
        pq.write_table(pa.Table.from_pylist([_row("What is 3+3?")]), f)
    ds = RLHFDataset.from_files("memory://bucket/d.parquet", TOK, max_prompt_length=64)
    assert ds[0]["input_ids"].tolist() == _ids(_prompt_text("What is 3+3?"))


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        RLHFDataset.from_files(str(tmp_path / "nope.parquet"), TOK, max_prompt_length=64)


LONG, SHORT = "x" * 40, "ok"
LIMIT = len(_prompt_text(SHORT)) + 5  # the char tokenizer: one token per character


def test_truncation_error_is_raised_up_front_with_the_fix():
    with pytest.raises(ValueError, match=r"1 prompts exceed data.max_prompt_length.*row 1.*truncation"):
        RLHFDataset([_row(SHORT), _row(LONG)], TOK, max_prompt_length=LIMIT, truncation="error")


def test_truncation_filter_drops_and_reports(caplog):
    with caplog.at_level(logging.WARNING):
        ds = RLHFDataset([_row(SHORT), _row(LONG), _row(SHORT)], TOK, max_prompt_length=LIMIT, truncation="filter")
    assert len(ds) == 2 and ds.skips.counts == {"overlong": 1} and ds.skips.examples == {"overlong": [1]}
    assert [ds[i]["index"] for i in range(2)] == [0, 2]
    assert "dropped 1 prompts (1 longer than" in caplog.text


@pytest.mark.parametrize("mode", ["left", "right"])
def test_truncation_left_right_match_naive_slices(mode):
    ds = RLHFDataset([_row(LONG), _row(SHORT)], TOK, max_prompt_length=LIMIT, truncation=mode)
    full = _ids(_prompt_text(LONG))
    want = full[-LIMIT:] if mode == "left" else full[:LIMIT]
    assert ds[0]["input_ids"].tolist() == want
    assert ds[1]["input_ids"].tolist() == _ids(_prompt_text(SHORT))


BAD_ROWS = [
    {"data_source": "x"},  # no prompt column
    _row("", prompt=None),  # missing prompt value
    _row("", prompt=""),  # empty string
    _row("", prompt=[]),  # empty message list
    _row("", prompt=[{"role": "user"}]),  # message without content
    _row("", prompt=12),  # wrong type
    _row("fine", reward_model="not a dict"),
    _row("fine", extra_info=[1, 2]),
    _row("fine", data_source=3),
]


def test_bad_rows_are_skipped_and_counted(caplog):
    rows = [_row("good one")] + BAD_ROWS + [_row("good two")]
    with caplog.at_level(logging.WARNING):
        ds = RLHFDataset(rows, TOK, max_prompt_length=64)
    assert len(ds) == 2 and ds.skips.counts == {"malformed": len(BAD_ROWS)}
    assert [ds[i]["index"] for i in range(2)] == [0, len(rows) - 1]
    assert f"skipped {len(BAD_ROWS)} of {len(rows)} rows: {len(BAD_ROWS)} malformed" in caplog.text
    assert "row 1:" in caplog.text


@pytest.mark.parametrize("k", range(len(BAD_ROWS)))
def test_strict_mode_raises_on_each_bad_row(k):
    with pytest.raises(ValueError, match="data row 1 is malformed"):
        RLHFDataset([_row("good"), BAD_ROWS[k]], TOK, max_prompt_length=64, strict=True)


def test_chat_template_choices():
    msgs = [{"role": "user", "content": "hi"}]
    raw = RLHFDataset([_row("", prompt=msgs)], TOK, max_prompt_length=64, chat_template="raw")
    assert raw[0]["input_ids"].tolist() == _ids("hi")
    custom = RLHFDataset([_row("", prompt=msgs)], TOK, max_prompt_length=64,
                         chat_template="{% for m in messages %}Q={{ m['content'] }};{% endfor %}A=")
    assert custom[0]["input_ids"].tolist() == _ids("Q=hi;A=")

    no_template = copy.deepcopy(TOK)  # a tokenizer without a chat template gets the plain one
    no_template.chat_template = None
    plain = RLHFDataset([_row("", prompt=msgs)], no_template, max_prompt_length=64)
    assert plain[0]["input_ids"].tolist() == _ids(plain_template(msgs, True)) == _ids(_prompt_text("hi"))


def test_collate_left_pads_to_longest_with_naive_positions():
    ds = RLHFDataset([_row("a"), _row("abcdef"), _row("abc")], TOK, max_prompt_length=64)
    items = [ds[i] for i in range(3)]
    batch = collate_rl(items, pad_token_id=TOK.pad_token_id)
    lens = [len(it["input_ids"]) for it in items]
    width = max(lens)
    assert batch.batch["input_ids"].shape == (3, width)
    for i, it in enumerate(items):
        pad = width - lens[i]
        assert batch.batch["input_ids"][i].tolist() == [TOK.pad_token_id] * pad + it["input_ids"].tolist()
        assert batch.batch["attention_mask"][i].tolist() == [0] * pad + [1] * lens[i]
        assert batch.batch["position_ids"][i].tolist() == [0] * pad + list(range(lens[i]))
    for key in ("data_source", "reward_model", "extra_info", "uid", "raw_prompt", "index"):
        assert len(batch.non_tensor_batch[key]) == 3, key
    assert batch.non_tensor_batch["raw_prompt"][0] == [{"role": "user", "content": "a"}]
    assert isinstance(batch.batch["input_ids"], torch.Tensor) and batch.batch["input_ids"].dtype == torch.long


def test_length_check_renders_each_distinct_prompt_once(monkeypatch, caplog):
    """Repeated prompts (built-in tasks repeat their problems) are rendered once; drops and order are as before."""
    from hybridflow.data import rl_dataset

    calls = []
    monkeypatch.setattr(rl_dataset, "render", lambda *a, **k: calls.append(a[1]) or render(*a, **k))
    rows = [_row(SHORT), _row(LONG), _row(SHORT), _row(SHORT)]
    with caplog.at_level(logging.WARNING):
        ds = RLHFDataset(rows, TOK, max_prompt_length=LIMIT, truncation="filter")
    assert len(calls) == 2  # SHORT and LONG, once each
    assert [ds[i]["index"] for i in range(len(ds))] == [0, 2, 3] and ds.skips.examples == {"overlong": [1]}
