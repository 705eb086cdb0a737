"""The `Tokenizer` protocol matches what a transformers tokenizer (the built-in one) really offers and returns."""

from __future__ import annotations

import inspect

from hybridflow.models.tokenizer import builtin_tokenizer
from hybridflow.utils.tokenizer_protocol import Tokenizer


def _members() -> dict[str, object]:
    return {name: value for name, value in vars(Tokenizer).items()
            if not name.startswith("_") or name == "__call__"} | dict.fromkeys(Tokenizer.__annotations__)


def test_every_protocol_member_exists_on_a_transformers_tokenizer() -> None:
    tok = builtin_tokenizer()
    missing = [name for name in _members() if not hasattr(tok, name)]
    assert not missing, f"Tokenizer protocol names members a transformers tokenizer lacks: {missing}"


def test_protocol_keywords_are_parameters_of_the_real_methods() -> None:
    tok = builtin_tokenizer()
    for name, value in _members().items():
        if not inspect.isfunction(value):
            continue
        declared = [p.name for p in inspect.signature(value).parameters.values() if p.name != "self"]
        real = inspect.signature(getattr(tok, name)).parameters
        unknown = [p for p in declared if p not in real]
        assert not unknown, f"Tokenizer.{name}: {unknown} are not parameters of {type(tok).__name__}.{name}"


def test_returns_are_the_types_the_protocol_states() -> None:
    tok = builtin_tokenizer()
    ids = tok.encode("ab c", add_special_tokens=False)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids, skip_special_tokens=True) == "ab c"
    assert tok.batch_decode([ids, ids[:1]], skip_special_tokens=True) == ["ab c", "a"]
    assert tok(text="ab c", add_special_tokens=False)["input_ids"] == ids
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=tok.chat_template,
                                   tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str) and text.endswith("Assistant:")
    assert isinstance(tok.pad_token_id, int) and isinstance(tok.eos_token_id, int)
    assert isinstance(tok.eos_token, str)
