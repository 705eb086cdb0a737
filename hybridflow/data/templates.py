"""Prompt normalisation and chat-template rendering: the one prompt-building path of train, SFT, RM, eval,
validation, `generate` and export.

A prompt is a list of chat messages (`{role, content}`) or a plain string (treated as one user message). It is
rendered with `data.chat_template` when set (`raw` = the messages' contents joined by newlines, no markup), else
the tokenizer's own template, else a plain "User: ...\\nAssistant:" template. Decision: every case is a Jinja
template (`template_for`) rendered by transformers' `apply_chat_template`, so the exported tokenizer carries the
very template training used and `apply_chat_template` outside hybridflow builds the same prompts.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hybridflow.utils.chat_template import template_for
from hybridflow.utils.tokenizer_protocol import Tokenizer

logger = logging.getLogger(__name__)

Messages = list[dict[str, str]]


class MalformedRow(ValueError):
    """A dataset row that cannot be used (missing prompt, wrong types)."""


def parse_rows(rows: Sequence[Any], parse: Callable[[Any], Any], name: str, strict: bool,
               origin: Callable[[int], str] = lambda i: "") -> list[Any]:
    """`parse(row)` for every row; a MalformedRow is an error when `strict`, else skipped and counted in one
    warning with the first row indices. An empty result is an error either way. `origin(i)`: where row i came from
    (e.g. " (file F, its row k)"), for the error."""
    out, bad = [], []
    for i, row in enumerate(rows):
        try:
            out.append(parse(row))
        except MalformedRow as err:
            if strict:
                raise ValueError(f"{name} row {i}{origin(i)} is malformed: {err}; fix it or set data.strict=false"
                                 ) from err
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
    """The fallback template's text (PLAIN_JINJA rendered in Python; tests compare the two)."""
    parts = []
    for m in messages:
        prefix = {"system": "", "user": "User: "}.get(m["role"], "Assistant: ")
        parts.append(f"{prefix}{m['content']}\n")
    if add_generation_prompt:
        parts.append("Assistant:")
    return "".join(parts)


def render(tokenizer: Tokenizer, messages: Messages, chat_template: str | None = None,
           add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None) -> str:
    """Messages → prompt text with `template_for(tokenizer, chat_template)` (never token ids: transformers 5
    `tokenize=True` returns a dict). `tools`: OpenAI function schemas for templates that read `tools`
    (multi-turn rollouts, `agentic/prompting.py`)."""
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, chat_template=template_for(tokenizer, chat_template),
                                         tokenize=False, add_generation_prompt=add_generation_prompt, **extra)


def prompt_ids(tokenizer: Tokenizer, prompt: Any, chat_template: str | None = None) -> list[int]:
    """A prompt cell (messages or a string) → the token ids every command feeds the model."""
    return encode(tokenizer, render(tokenizer, to_messages(prompt), chat_template))


def save_tokenizer(tokenizer: Tokenizer, out_dir: str | Path, chat_template: str | None) -> None:
    """Save `tokenizer` into `out_dir` carrying the template training used (`template_for`), both as
    transformers 5 writes it (chat_template.jinja) and as `chat_template` in tokenizer_config.json (older readers).
    The tokenizer passed in is not modified (the built-in one is a shared cached object)."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template_for(tokenizer, chat_template)
    out = Path(out_dir)
    tok.save_pretrained(str(out))
    cfg_file = out / "tokenizer_config.json"
    data = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    data["chat_template"] = tok.chat_template
    cfg_file.write_text(json.dumps(data, indent=2))


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of `text` without special tokens; fast tokenizers skip transformers' per-call Python overhead
    (half the cost of a short prompt), others go through `tokenizer(text)`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode(text, add_special_tokens=False).ids
    return tokenizer(text, add_special_tokens=False)["input_ids"]
