"""`hybridflow generate`: parquet of prompts in, parquet with n responses per prompt out."""

from __future__ import annotations

from hybridflow.cli import main
from hybridflow.commands.generate import _prompt_text
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
    assert _prompt_text(builtin_tokenizer(), "plain text", "prompt") == "plain text"
    assert _prompt_text(builtin_tokenizer(), prompts[0], "prompt") == "User: What is 0 + 0?\nAssistant:"
