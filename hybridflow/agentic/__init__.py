"""Agentic RL: tools, interactions, tool-call formats and the host-side session of multi-turn rollouts."""

from hybridflow.agentic.chat_delta import ChatDelta
from hybridflow.agentic.formats import TOOL_FORMATS, ToolCall, ToolFormat, get_format
from hybridflow.agentic.interactions import (
    BUILTIN_INTERACTIONS,
    GuessNumberInteraction,
    Interaction,
    InteractionStep,
    load_interactions,
)
from hybridflow.agentic.session import ToolSession, TurnResult
from hybridflow.agentic.tools import BUILTIN_TOOLS, Tool, ToolContext, ToolResult, build_tools, load_tools

__all__ = ["BUILTIN_INTERACTIONS", "BUILTIN_TOOLS", "TOOL_FORMATS", "ChatDelta", "GuessNumberInteraction",
           "Interaction", "InteractionStep", "Tool", "ToolCall", "ToolContext", "ToolFormat", "ToolResult",
           "ToolSession", "TurnResult", "build_tools", "get_format", "load_interactions", "load_tools"]
