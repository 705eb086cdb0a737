"""`hybridflow generate`: parquet of prompts in, parquet with n responses per prompt out."""

from __future__ import annotations

from hybridflow.cli import main
from hybridflow.commands.generate import _prompt_ids
from hybridflow.data.parquet_io import read_rows, write_rows
from hybridflow.models.tokenizer import builtin_tokenizer


def test_generate_cli_roundtrip(tmp_path, capsys):
    src, dst = tmp_path / "prompts.parquet", tmp_path / "out.parquet"
    prompts = [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(5)]
    write_rows([{"prompt": p, "index": i} for i, p in enumerate(prompts)], src)
    common = ["generate", "--input", str(src), "--output", str(dst), "rollout.n=2", "data.max_response_length=6"]
    assert main([*common, "--batch-size", "4"]) == 0
    rows = read_rows(str(dst))
    assert [r["index"] for r in rows] == list(range(5))
    assert all(len(r["responses"]) == 2 and all(1 <= n <= 6 for n in r["response_lengths"]) for r in rows)
    assert all(isinstance(t, str) for r in rows for t in r["responses"])
    # per-prompt seeds: the batch size does not change the samples
    assert main([*common, "--batch-size", "3"]) == 0
    assert [r["responses"] for r in read_rows(str(dst))] == [r["responses"] for r in rows]
    assert main(["generate", "--input", str(src), "--output", str(dst), "data.max_prompt_length=4"]) == 2
    assert "data.max_prompt_length=4" in capsys.readouterr().err
    tok = builtin_tokenizer()
    # a string is one user message, as in training; `raw` leaves it as it is
    assert tok.decode(_prompt_ids(tok, "plain text", "prompt", 0, None)) == "User: plain text\nAssistant:"
    assert tok.decode(_prompt_ids(tok, "plain text", "prompt", 0, "raw")) == "plain text"
    assert tok.decode(_prompt_ids(tok, prompts[0], "prompt", 0, None)) == "User: What is 0 + 0?\nAssistant:"


def test_generate_uses_data_chat_template(tmp_path, capsys):
    """The config that trains also generates: `data.chat_template=raw` keeps a short prompt short (it was ignored,
    and the built-in "User: ... Assistant:" wrapping overflowed data.max_prompt_length)."""
    src, dst = tmp_path / "prompts.parquet", tmp_path / "out.parquet"
    write_rows([{"prompt": [{"role": "user", "content": "1+2="}]}], src)
    common = ["generate", "--input", str(src), "--output", str(dst), "data.max_prompt_length=5",
              "data.max_response_length=2"]
    assert main([*common, "data.chat_template=raw"]) == 0
    assert main(common) == 2
    assert "data.chat_template=None" in capsys.readouterr().err
