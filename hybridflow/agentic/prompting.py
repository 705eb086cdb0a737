"""Offering the tools to the model in its prompt: `apply_chat_template(messages, tools=[schemas])` when the chat
template reads a `tools` variable (Qwen2.5, Llama 3.1, Hermes, ... write the schemas into the system turn in the
format the model was trained on). A template that does not (the built-in plain one, `raw`) gets no schemas: the
prompts must describe the tools themselves, as before. `rollout.multi_turn.offer_tools_in_prompt=false` turns
this off.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2 import meta

from hybridflow.agentic.tools import build_tools
from hybridflow.utils.chat_template import template_for
from hybridflow.utils.tokenizer_protocol import Tokenizer

if TYPE_CHECKING:
    from hybridflow.config.schema import MultiTurnConfig

logger = logging.getLogger(__name__)


def template_reads_tools(template: str) -> bool:
    """Does the Jinja chat template use a `tools` variable?"""
    try:
        ast = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"the chat template does not parse as Jinja ({err}); fix data.chat_template") from None
    return "tools" in meta.find_undeclared_variables(ast)


def prompt_tools(mt_cfg: MultiTurnConfig | None, tokenizer: Tokenizer, chat_template: str | None = None
                 ) -> list[dict[str, Any]] | None:
    """The tool schemas the dataset passes to `apply_chat_template(tools=...)`, or None (single-turn, no tools,
    offering off, or a template without tool support)."""
    if mt_cfg is None or not mt_cfg.enable or not mt_cfg.offer_tools_in_prompt:
        return None
    tools = build_tools(mt_cfg.tool_config_path, list(mt_cfg.tools))
    if not tools:
        return None
    if not template_reads_tools(template_for(tokenizer, chat_template)):
        logger.info("multi-turn: the chat template has no `tools` variable, so the tool schemas are not added to "
                    "the prompts (describe the tools in the prompts, or use a template that takes tools=)")
        return None
    return [t.schema() for t in tools.values()]
