"""SFT reads verl's and TRL's layouts — `messages`, prompt + `response`, prompt + `completion` (text or messages),
`text` — and a file in none of them fails naming the accepted layouts and the columns it has (not as N skipped
malformed rows)."""

from __future__ import annotations

import pytest

from hybridflow.data import SFTDataset
from hybridflow.data.templates import render
from hybridflow.models.tokenizer import builtin_tokenizer

TOK = builtin_tokenizer()
EOS = TOK.eos_token


def _trained(ds: SFTDataset, i: int = 0) -> str:
    item = ds[i]
    return TOK.decode(item["input_ids"][item["loss_mask"].bool()])


def test_trl_prompt_completion_text() -> None:
    ds = SFTDataset([{"prompt": "2+2?", "completion": " 4"}] * 3, TOK, max_length=100)
    assert len(ds) == 3 and ds.layout == "prompt+completion"
    assert TOK.decode(ds[0]["input_ids"]) == f"User: 2+2?\nAssistant: 4{EOS}" and _trained(ds) == f" 4{EOS}"


def test_trl_conversational_prompt_completion_trains_only_the_completion() -> None:
    row = {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                      {"role": "user", "content": "2+2?"}],
           "completion": [{"role": "assistant", "content": "4"}]}
    ds = SFTDataset([row], TOK, max_length=200)
    assert TOK.decode(ds[0]["input_ids"]) == f"User: hi\nAssistant: yo{EOS}\nUser: 2+2?\nAssistant: 4{EOS}"
    assert _trained(ds) == f" 4{EOS}"


def test_trl_text_layout_trains_every_token() -> None:
    ds = SFTDataset([{"text": "The sum of 2 and 2 is 4."}], TOK, max_length=100)
    item = ds[0]
    assert ds.layout == "text" and bool(item["loss_mask"].all())
    assert TOK.decode(item["input_ids"]) == f"The sum of 2 and 2 is 4.{EOS}"


def test_verl_prompt_response_and_messages_unchanged() -> None:
    assert SFTDataset([{"prompt": "q", "response": "a"}], TOK, max_length=50).layout == "prompt+response"
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert SFTDataset([{"messages": msgs}], TOK, max_length=50).layout == "messages"


def test_unknown_layout_lists_the_accepted_ones() -> None:
    rows = [{"question": f"q{i}", "answer": "a"} for i in range(7200)]
    with pytest.raises(ValueError) as err:
        SFTDataset(rows, TOK, max_length=50, name="sft-train")
    text = str(err.value)
    for layout in ("`messages`", "`prompt` + `response`", "`prompt` + `completion`", "`text`"):
        assert layout in text
    assert "['question', 'answer']" in text and "data.prompt_key=question" in text


def test_repeated_rows_are_rendered_once_and_keep_their_own_samples(monkeypatch) -> None:
    """Rows that differ only outside the fields a sample is built from (the index) are rendered once."""
    from hybridflow.data import sft_dataset

    calls = []
    monkeypatch.setattr(sft_dataset, "render", lambda *a, **k: calls.append(a[1]) or render(*a, **k))
    rows = [{"prompt": "2+2?", "response": a, "extra_info": {"index": i}} for i, a in enumerate(["4", "5", "4", "4"])]
    ds = SFTDataset(rows, TOK, max_length=100)
    assert len(calls) == 2  # one prompt render per distinct (prompt, response)
    assert [_trained(ds, i) for i in range(4)] == [f"{a}{EOS}" for a in ["4", "5", "4", "4"]]


def test_a_malformed_row_names_its_file(tmp_path) -> None:
    from hybridflow.data.parquet_io import write_rows
    good = {"prompt": "2+2?", "completion": " 4"}
    a = write_rows([good, good], tmp_path / "a.parquet")
    b = write_rows([good, {"prompt": None, "completion": " 5"}], tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=rf"sft row 3 \(file {b}, its row 1\) is malformed: prompt is missing"):
        SFTDataset.from_files([str(a), str(b)], TOK, max_length=100, strict=True)
    assert len(SFTDataset.from_files([str(a), str(b)], TOK, max_length=100)) == 3  # not strict: skipped
