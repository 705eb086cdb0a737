"""Agentic RL: tools, tool-call formats and the host-side tool session of multi-turn rollouts."""

from hybridflow.agentic.formats import TOOL_FORMATS, ToolCall, ToolFormat, get_format
from hybridflow.agentic.session import ToolSession
from hybridflow.agentic.tools import BUILTIN_TOOLS, Tool, ToolContext, ToolResult, build_tools, load_tools

__all__ = ["BUILTIN_TOOLS", "TOOL_FORMATS", "Tool", "ToolCall", "ToolContext", "ToolFormat", "ToolResult",
           "ToolSession", "build_tools", "get_format", "load_tools"]
