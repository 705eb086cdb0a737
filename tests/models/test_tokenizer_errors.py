"""A damaged tokenizer file fails with an error that names the file and the fix (not a bare JSONDecodeError)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.config import load_config
from hybridflow.models import load_tokenizer
from hybridflow.models.tokenizer import builtin_tokenizer


def _cut(path: Path, keep: float = 0.4) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize("content", [None, '{"version": "1.0", "model": 5}'])
def test_damaged_tokenizer_json_names_the_file(tmp_path, content) -> None:
    builtin_tokenizer().save_pretrained(tmp_path)
    target = tmp_path / "tokenizer.json"
    if content is None:
        _cut(target)  # truncated: not JSON
    else:
        target.write_text(content)  # JSON the tokenizers library refuses
    cfg = load_config([], [f"model.tokenizer_path={tmp_path}"], validate=False).model
    with pytest.raises(ValueError) as err:
        load_tokenizer(cfg)
    assert str(target) in str(err.value) and "model.tokenizer_path" in str(err.value) and "Fix:" in str(err.value)
