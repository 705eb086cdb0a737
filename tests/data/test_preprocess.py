"""`hybridflow data prepare gsm8k|math|arithmetic` writes verl-schema parquet that RLHFDataset reads."""

from __future__ import annotations

import json

import pytest

from hybridflow.cli import main
from hybridflow.data import RLHFDataset, read_rows, write_rows
from hybridflow.data.preprocess import GSM8K_INSTRUCTION, MATH_INSTRUCTION, split_name
from hybridflow.models.tokenizer import builtin_tokenizer
from hybridflow.rewards import select_reward_fn

GSM8K = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
    {"question": "Big numbers?", "answer": "so\n#### 1,200"},
    {"question": "broken", "answer": "no final answer"},
]
MATH = [
    {"problem": "What is 1/2 as a fraction?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1",
     "type": "Algebra"},
    {"problem": "Nested?", "solution": "So $\\boxed{x^{2}+\\frac{1}{3}}$", "level": "Level 2", "type": "Algebra"},
    {"problem": "No box", "solution": "42"},
]


def _jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_gsm8k_prepare_from_jsonl_and_parquet(tmp_path):
    src = _jsonl(tmp_path / "gsm8k_test.jsonl", GSM8K)
    assert main(["data", "prepare", "gsm8k", "--input", str(src), "--out", str(tmp_path / "out")]) == 0
    rows = read_rows(str(tmp_path / "out" / "test.parquet"))
    assert len(rows) == 2  # the record without "####" is skipped
    assert rows[0]["data_source"] == "openai/gsm8k" and rows[0]["ability"] == "math"
    assert rows[0]["prompt"][0]["content"].endswith(GSM8K_INSTRUCTION)
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "1200"]
    assert rows[1]["extra_info"]["split"] == "test" and rows[1]["extra_info"]["index"] == 1
    fn = select_reward_fn(rows[0]["data_source"])
    assert fn("openai/gsm8k", "... #### 7", rows[0]["reward_model"]["ground_truth"], None) == 1.0
    # parquet input with an explicit split
    write_rows(GSM8K, tmp_path / "raw.parquet")
    assert main(["data", "prepare", "gsm8k", "--input", str(tmp_path / "raw.parquet"), "--split", "train",
                 "--out", str(tmp_path / "out2")]) == 0
    ds = RLHFDataset.from_files(str(tmp_path / "out2" / "train.parquet"), builtin_tokenizer(),
                                max_prompt_length=200)
    assert len(ds) == 2


def test_math_prepare_extracts_boxed_answers(tmp_path):
    src = tmp_path / "math.json"
    src.write_text(json.dumps(MATH))
    assert main(["data", "prepare", "math", "--input", str(src), "--out", str(tmp_path / "o")]) == 0
    rows = read_rows(str(tmp_path / "o" / "train.parquet"))
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["\\frac{1}{2}", "x^{2}+\\frac{1}{3}"]
    assert rows[0]["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert rows[0]["prompt"][0]["content"].endswith(MATH_INSTRUCTION) and rows[0]["extra_info"]["level"] == "Level 1"


def test_builtin_task_export_and_errors(tmp_path, capsys):
    assert main(["data", "prepare", "sort", "--out", str(tmp_path), "--train-size", "12", "--val-size", "3"]) == 0
    assert len(read_rows(str(tmp_path / "train.parquet"))) == 12 and len(read_rows(str(tmp_path / "val.parquet"))) == 3
    assert main(["data", "prepare", "gsm8k", "--out", str(tmp_path)]) == 2
    assert main(["data", "prepare", "gsm8k", "--input", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path)]) == 2
    assert "is not a file" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["data", "prepare", "unknown", "--out", str(tmp_path)])


def test_split_names():
    assert [split_name(p) for p in ("a/gsm8k_test.jsonl", "train.parquet", "x_validation.json", "foo.jsonl")] == [
        "test", "train", "validation", "train"]
