"""One prompt-building path: every `data.chat_template` choice is a Jinja template, and a tokenizer saved with
`save_tokenizer` rebuilds the same prompt text through plain transformers `apply_chat_template`."""

from __future__ import annotations

import copy
import json

import pytest
from transformers import AutoTokenizer

from hybridflow.data.templates import plain_template, render, save_tokenizer
from hybridflow.models.tokenizer import builtin_tokenizer
from hybridflow.utils.chat_template import RAW_TEMPLATE, template_for

TOK = builtin_tokenizer()
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c d"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_raw_and_plain_templates_match_their_python_meaning(messages):
    assert render(TOK, messages, RAW_TEMPLATE) == "\n".join(m["content"] for m in messages)
    no_template = copy.deepcopy(TOK)
    no_template.chat_template = None
    for gen in (True, False):
        assert render(no_template, messages, None, gen) == plain_template(messages, gen)


@pytest.mark.parametrize("chat_template", [RAW_TEMPLATE, None, "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"])
def test_saved_tokenizer_reproduces_training_prompts(tmp_path, chat_template):
    save_tokenizer(TOK, tmp_path, chat_template)
    assert TOK.chat_template != template_for(TOK, RAW_TEMPLATE)  # the shared built-in tokenizer is not modified
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"] == template_for(
        TOK, chat_template)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    for messages in CONVERSATIONS:
        assert loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            render(TOK, messages, chat_template)
