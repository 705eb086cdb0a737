"""`Tokenizer`: the part of a Hugging Face tokenizer that hybridflow calls, as a structural type.

Decision: a Protocol, not `PreTrainedTokenizerBase`, so that datasets, rewards, rollouts and tool sessions accept the
built-in tokenizer, any transformers tokenizer and the small fakes tests write, without importing transformers. It
sits in utils/ because utils/chat_template.py takes one too, and utils/ is below every package that does. Return
types are what these calls give for the arguments used here (a flat id list decodes to one string; a chat template
rendered with `tokenize=False` is text), narrower than transformers' annotated unions. Fast-tokenizer shortcuts
(`backend_tokenizer`, `clean_up_tokenization_spaces`) are read with `getattr` and are not part of the contract.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol


class Tokenizer(Protocol):
    chat_template: str | None  # Jinja; None when the tokenizer ships none (`utils.chat_template.template_for`)

    @property
    def pad_token_id(self) -> int | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def eos_token(self) -> str | None: ...

    def __call__(self, text: str, *, add_special_tokens: bool = ...) -> Mapping[str, list[int]]: ...

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = ...) -> str: ...

    def batch_decode(self, sequences: list[list[int]], *, skip_special_tokens: bool = ...) -> list[str]: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = ...,
                            chat_template: str | None = ..., tokenize: bool = ...,
                            add_generation_prompt: bool = ...) -> str: ...

    def save_pretrained(self, save_directory: str | Path) -> object: ...
