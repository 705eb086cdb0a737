"""Which Jinja chat template prompts are built with (`template_for`): shared by the datasets (`data/templates.py`)
and multi-turn rollouts (`agentic/`), so it sits below both."""

from __future__ import annotations

from hybridflow.utils.tokenizer_protocol import Tokenizer

RAW_TEMPLATE = "raw"  # `data.chat_template=raw`
# `raw`: contents joined by "\n", nothing added for the generation prompt. transformers renders chat templates with
# trim_blocks, so the newline is an expression, not a literal after a block tag.
RAW_JINJA = "{% for m in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}{{ m['content'] }}{% endfor %}"
# For tokenizers without a template: "User: ...\nAssistant:" (the built-in tokenizer's template, minus its EOS).
PLAIN_JINJA = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] + '\\n' }}"
    "{% elif m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\\n' }}"
    "{% else %}{{ 'Assistant: ' + m['content'] + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def template_for(tokenizer: Tokenizer, chat_template: str | None = None) -> str:
    """The Jinja template prompts are built with: `data.chat_template` (`raw` → RAW_JINJA), else the tokenizer's,
    else PLAIN_JINJA. Export writes this string into the tokenizer it saves."""
    if chat_template == RAW_TEMPLATE:
        return RAW_JINJA
    return chat_template or getattr(tokenizer, "chat_template", None) or PLAIN_JINJA
