"""Tools a policy calls during a multi-turn rollout: the `Tool` interface, built-ins, and YAML loading.

A tool is an OpenAI function schema plus `execute(arguments, context) -> ToolResult`. Stateful tools may override
`create`/`release` (called once per trajectory, around its calls). Built-ins: `calculator` (an AST walk over
numbers and + - * / // % ** and parentheses: no `eval`; exponents and integer sizes are checked before each
operation, so a call never runs long) and `python` (the reward sandbox, `sandbox.run_python`:
time/memory limits, no network, private tmpfs). User tools are loaded from the YAML
named by `rollout.multi_turn.tool_config_path` (verl's layout: `tools: [{class_name, config, tool_schema}]`).
"""

from __future__ import annotations

import ast
import logging
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.agentic.plugins import import_class, yaml_entries
from hybridflow.sandbox import run_python

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolResult:
    text: str  # what the model sees as the tool's response
    reward: float | None = None  # optional per-call reward: added at the end of the calling turn (turn_rewards)
    metrics: dict[str, float] = field(default_factory=dict)
    is_error: bool = False  # the call failed (bad arguments, runtime error): counted in `tool_errors`


@dataclass(frozen=True)
class ToolContext:
    """What a call knows about its trajectory: a stable id, this row's `extra_info.tools_kwargs[<tool name>]`
    (verl's schema: `{"create_kwargs": {...}, "execute_kwargs": {...}}`) and a per-trajectory `state` dict that
    `create`/`execute`/`release` of this tool share."""

    trajectory_id: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)

    # Keys whose value is None are dropped: a parquet file gives every row the keys any row has, as None.
    @property
    def create_kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in (self.kwargs.get("create_kwargs") or {}).items() if v is not None}

    @property
    def execute_kwargs(self) -> dict[str, Any]:
        return {k: v for k, v in (self.kwargs.get("execute_kwargs") or {}).items() if v is not None}


class Tool:
    """Base class: subclasses set `name`, `description`, `parameters` (JSON schema) or pass a full `schema`."""

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}

    def __init__(self, config: dict[str, Any] | None = None, schema: dict[str, Any] | None = None) -> None:
        self.config = dict(config or {})
        if schema is not None:
            fn = schema.get("function", schema)
            self.name, self.description = fn["name"], fn.get("description", "")
            self.parameters = fn.get("parameters", {"type": "object", "properties": {}})
        if not self.name:
            raise ValueError(f"{type(self).__name__} has no name: set the class attribute `name` or give a "
                             "`tool_schema` with function.name in the tool config")

    def schema(self) -> dict[str, Any]:
        """The OpenAI function schema (what `apply_chat_template(tools=...)` takes)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def create(self, context: ToolContext) -> None:
        """Per-trajectory set-up, before its first call to this tool."""

    def release(self, context: ToolContext) -> None:
        """Per-trajectory clean-up, after the trajectory ends (only if `create` ran)."""

    def execute(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------- calculator
_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64
MAX_EXPRESSION_CHARS = 200
# Integer results are capped BEFORE they are computed: one big-int multiply or power is a single C call that
# holds the GIL, so no timeout (not even rollout.multi_turn.tool_timeout_s) could interrupt it.
MAX_INT_BITS = 4096  # ~1233 decimal digits; each operation on such numbers takes microseconds


def safe_arithmetic(expression: str) -> int | float:
    """Value of an arithmetic expression: numbers, + - * / // % **, unary +/-, parentheses. Anything else
    (names, calls, attributes, exponents above MAX_EXPONENT, integers above MAX_INT_BITS, float overflow) raises
    ValueError. Parsed with `ast`, evaluated by walking the tree; sizes are checked before each operation."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression: {err.msg}") from None
    return _walk(tree.body)


def _walk(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_walk(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _walk(node.left), _walk(node.right)
        _check_size(node.op, left, right)
        try:
            return _bounded(_BINOPS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("result too large for a float") from None
    raise ValueError(f"unsupported syntax: {type(node).__name__} (only numbers, + - * / // % ** and parentheses)")


def _check_size(op: ast.operator, left: int | float, right: int | float) -> None:
    """Refuse an operation whose integer result would exceed MAX_INT_BITS, from the operands' sizes alone."""
    if isinstance(op, ast.Pow):
        if abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} too large (|exponent| <= {MAX_EXPONENT})")
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                and abs(left).bit_length() * right > MAX_INT_BITS:
            raise ValueError(f"result too large (over {MAX_INT_BITS} bits)")
    elif isinstance(op, ast.Mult) and isinstance(left, int) and isinstance(right, int) \
            and abs(left).bit_length() + abs(right).bit_length() > MAX_INT_BITS + 1:
        raise ValueError(f"result too large (over {MAX_INT_BITS} bits)")


def _bounded(x: int | float | complex) -> int | float:
    if isinstance(x, complex):  # a negative number to a fractional power
        raise ValueError("the result is not a real number")
    if isinstance(x, int) and x.bit_length() > MAX_INT_BITS:
        raise ValueError(f"result too large (over {MAX_INT_BITS} bits)")
    return x


def format_number(x: int | float) -> str:
    if isinstance(x, float) and math.isfinite(x) and x.is_integer() and abs(x) < 2**53:
        return str(int(x))
    return repr(x)


class CalculatorTool(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression with + - * / // % ** and parentheses."
    parameters = {"type": "object", "required": ["expression"],
                  "properties": {"expression": {"type": "string", "description": "e.g. 123 * 456"}}}

    def execute(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        expr = arguments.get("expression")
        if not isinstance(expr, str):
            return ToolResult("Error: calculator needs a string argument 'expression'", is_error=True)
        try:
            return ToolResult(format_number(safe_arithmetic(expr)))
        except ValueError as err:
            return ToolResult(f"Error: {err}", is_error=True)


# -------------------------------------------------------------------------------------------------- python
class PythonTool(Tool):
    """Runs `code` in the reward sandbox; the response is stdout (and stderr on failure). Config:
    `timeout_s`, `memory_mb` (may only lower `reward.sandbox.*`)."""

    name = "python"
    description = "Run a Python program and return what it prints."
    parameters = {"type": "object", "required": ["code"],
                  "properties": {"code": {"type": "string", "description": "a complete Python program"}}}

    def execute(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult("Error: python needs a string argument 'code'", is_error=True)
        res = run_python(code, timeout_s=self.config.get("timeout_s"), memory_mb=self.config.get("memory_mb"))
        if res.timed_out:
            return ToolResult("Error: the program timed out", is_error=True, metrics={"python/timeouts": 1.0})
        if res.returncode != 0:
            return ToolResult(f"Error (exit {res.returncode}):\n{res.stderr[-1000:]}", is_error=True)
        return ToolResult(res.stdout)


BUILTIN_TOOLS: dict[str, type[Tool]] = {"calculator": CalculatorTool, "python": PythonTool}


# ------------------------------------------------------------------------------------------------- loading
def load_tools(path: str | Path) -> dict[str, Tool]:
    """Tools from a YAML file: `tools: [{class_name: calculator | pkg.mod.Class, config: {...},
    tool_schema: {...optional OpenAI schema...}}]`. Names must be unique."""
    tools: dict[str, Tool] = {}
    for where, entry in yaml_entries(path, "rollout.multi_turn.tool_config_path", "tools",
                                     ("class_name", "config", "tool_schema")):
        cls = import_class(str(entry["class_name"]), where, BUILTIN_TOOLS, Tool, "tool")
        tool = cls(config=entry.get("config") or {}, schema=entry.get("tool_schema"))
        if tool.name in tools:
            raise ValueError(f"{where}: a tool named {tool.name!r} is already defined; names must be unique")
        tools[tool.name] = tool
    return tools


def build_tools(tool_config_path: str | None, builtin: list[str]) -> dict[str, Tool]:
    """The tools of a run: `rollout.multi_turn.tools` (built-in names) plus those of the tool config file."""
    tools: dict[str, Tool] = {}
    for name in builtin:
        if name not in BUILTIN_TOOLS:
            raise ValueError(f"rollout.multi_turn.tools: unknown built-in tool {name!r}; built-ins are "
                             f"{', '.join(BUILTIN_TOOLS)} (user tools go in rollout.multi_turn.tool_config_path)")
        tools[name] = BUILTIN_TOOLS[name]()
    if tool_config_path:
        for name, tool in load_tools(tool_config_path).items():
            if name in tools:
                raise ValueError(f"tool {name!r} is both in rollout.multi_turn.tools and in {tool_config_path}; "
                                 "keep one")
            tools[name] = tool
    return tools
