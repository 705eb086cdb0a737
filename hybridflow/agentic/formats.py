"""Tool-call formats: how calls are parsed out of an assistant turn and how tool responses are written back.

A format is a pair (parse a turn's text → calls, render the tool results → the text appended after the turn's end
token), chosen by `rollout.multi_turn.format` from `TOOL_FORMATS`. `hermes` is Qwen2.5's chat template
(`<tool_call>{json}</tool_call>` in the assistant turn; responses in a `user` turn of `<tool_response>` blocks);
`hermes_plain` parses the same calls but writes the built-in tokenizer's plain "User: ... / Assistant:" turns;
`hermes_template` parses the same calls and writes the responses as `tool` messages through the chat template in
use (`ChatDelta`), so any template that knows the `tool` role lays them out itself.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # set when the call is malformed; the error text goes back to the model


class ToolFormat:
    """Interface: `parse(turn_text) -> [ToolCall]` (empty = the trajectory ends) and `render(results) -> str`."""

    name = ""
    via_template = False  # True: the session renders the responses as `tool` messages through the chat template

    def parse(self, text: str) -> list[ToolCall]:
        raise NotImplementedError

    def render(self, results: list[str]) -> str:
        raise NotImplementedError


class HermesFormat(ToolFormat):
    """Qwen2.5 / Hermes: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, several per turn."""

    name = "hermes"
    prefix = "\n<|im_start|>user\n"
    suffix = "<|im_end|>\n<|im_start|>assistant\n"

    def parse(self, text: str) -> list[ToolCall]:
        calls = [self._one(m.group(1)) for m in TOOL_CALL_RE.finditer(text)]
        opened, closed = text.count("<tool_call>"), text.count("</tool_call>")
        if opened > len(calls) or closed > len(calls):  # an unterminated or stray tag is a malformed call too
            calls.append(ToolCall("", error="unbalanced <tool_call> tags: write <tool_call>{json}</tool_call>"))
        return calls

    @staticmethod
    def _one(body: str) -> ToolCall:
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as err:
            return ToolCall("", error=f"tool call is not valid JSON ({err.msg} at char {err.pos})")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ToolCall("", error='tool call needs {"name": "<tool>", "arguments": {...}}')
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models emit the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return ToolCall(obj["name"], error="tool call arguments are not a JSON object")
        if not isinstance(args, dict):
            return ToolCall(obj["name"], error="tool call arguments are not a JSON object")
        return ToolCall(obj["name"], args)

    def render(self, results: list[str]) -> str:
        body = "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)
        return self.prefix + body + self.suffix


class HermesPlainFormat(HermesFormat):
    """Hermes calls inside the built-in tokenizer's plain template (`models/tokenizer.CHAT_TEMPLATE`)."""

    name = "hermes_plain"
    prefix = "\nUser: "
    suffix = "\nAssistant:"

    def render(self, results: list[str]) -> str:
        return self.prefix + "".join(f"<tool_response>{r}</tool_response>" for r in results) + self.suffix


class HermesTemplateFormat(HermesFormat):
    """Hermes calls; responses are `{"role": "tool", "content": ...}` messages rendered by the chat template."""

    name = "hermes_template"
    via_template = True

    def render(self, results: list[str]) -> str:
        raise NotImplementedError("hermes_template responses are rendered by the chat template (ToolSession)")


TOOL_FORMATS: dict[str, type[ToolFormat]] = {"hermes": HermesFormat, "hermes_plain": HermesPlainFormat,
                                             "hermes_template": HermesTemplateFormat}


def get_format(name: str) -> ToolFormat:
    if name not in TOOL_FORMATS:
        raise ValueError(f"rollout.multi_turn.format={name!r}: unknown; valid: {', '.join(TOOL_FORMATS)} "
                         "(register a ToolFormat subclass in hybridflow.agentic.formats.TOOL_FORMATS)")
    return TOOL_FORMATS[name]()
