"""Prompt normalisation and chat-template rendering.

A prompt is a list of chat messages (`{role, content}`) or a plain string (treated as one user message). It is
rendered with `data.chat_template` when set (`raw` = no template at all), else the tokenizer's own template, else a
plain "User: ...\\nAssistant:" template — the same text the built-in tokenizer's template produces.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

Messages = list[dict[str, str]]
RAW_TEMPLATE = "raw"


class MalformedRow(ValueError):
    """A dataset row that cannot be used (missing prompt, wrong types)."""


def parse_rows(rows: Sequence[Any], parse: Callable[[Any], Any], name: str, strict: bool) -> list[Any]:
    """`parse(row)` for every row; a MalformedRow is an error when `strict`, else skipped and counted in one
    warning with the first row indices. An empty result is an error either way."""
    out, bad = [], []
    for i, row in enumerate(rows):
        try:
            out.append(parse(row))
        except MalformedRow as err:
            if strict:
                raise ValueError(f"{name} row {i} is malformed: {err}; fix it or set data.strict=false") from err
            bad.append(i)
    if bad:
        logger.warning("%s: skipped %d malformed rows (first indices %s)", name, len(bad), bad[:10])
    if not out:
        raise ValueError(f"{name} dataset is empty ({len(rows)} rows, {len(bad)} malformed)")
    return out


def to_messages(prompt: Any) -> Messages:
    """A prompt cell → a list of `{role, content}` dicts; raises MalformedRow with the reason."""
    if prompt is None:
        raise MalformedRow("prompt is missing")
    if isinstance(prompt, str):
        if not prompt:
            raise MalformedRow("prompt is an empty string")
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, dict):
        prompt = [prompt]
    if not isinstance(prompt, Sequence) and not hasattr(prompt, "tolist"):
        raise MalformedRow(f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
    messages = list(prompt.tolist() if hasattr(prompt, "tolist") else prompt)
    if not messages:
        raise MalformedRow("prompt is an empty message list")
    out: Messages = []
    for j, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
            raise MalformedRow(f"prompt message {j} must be a dict with string 'role' and 'content', got {msg!r}")
        out.append({"role": msg["role"], "content": msg["content"]})
    return out


def plain_template(messages: Messages, add_generation_prompt: bool) -> str:
    """The fallback template for tokenizers without one (matches the built-in tokenizer's template)."""
    parts = []
    for m in messages:
        if m["role"] == "system":
            parts.append(f"{m['content']}\n")
        elif m["role"] == "user":
            parts.append(f"User: {m['content']}\n")
        else:
            parts.append(f"Assistant: {m['content']}\n")
    if add_generation_prompt:
        parts.append("Assistant:")
    return "".join(parts)


def render(tokenizer: Any, messages: Messages, chat_template: str | None = None,
           add_generation_prompt: bool = True) -> str:
    """Messages → prompt text (never token ids: transformers 5 `tokenize=True` returns a dict)."""
    if chat_template == RAW_TEMPLATE:
        return "\n".join(m["content"] for m in messages)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        return plain_template(messages, add_generation_prompt)
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` without special tokens; fast tokenizers skip transformers' per-call Python overhead
    (half the cost of a short prompt), others go through `tokenizer(text)`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode(text, add_special_tokens=False).ids
    return tokenizer(text, add_special_tokens=False)["input_ids"]
