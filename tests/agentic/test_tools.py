"""Tool-call parsing, the calculator, tool config loading and the tool session's error/timeout paths."""

from __future__ import annotations

import time

import pytest

from hybridflow.agentic.formats import HermesFormat, HermesPlainFormat, get_format
from hybridflow.agentic.session import ToolSession
from hybridflow.agentic.tools import (
    CalculatorTool,
    Tool,
    ToolContext,
    ToolResult,
    load_tools,
    safe_arithmetic,
)
from hybridflow.models.tokenizer import builtin_tokenizer


class SlowTool(Tool):
    name = "slow"

    def execute(self, arguments, context):
        time.sleep(float(arguments.get("s", 1.0)))
        return ToolResult("late")


class BoomTool(Tool):
    name = "boom"

    def execute(self, arguments, context):
        raise RuntimeError("kaput")


# ------------------------------------------------------------------------------------------------ parser
def test_hermes_parses_one_and_several_calls():
    fmt = HermesFormat()
    text = 'think <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
    (call,) = fmt.parse(text)
    assert (call.name, call.arguments, call.error) == ("calculator", {"expression": "2*3"}, None)
    two = fmt.parse(text + '\n<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n</tool_call>')
    assert [c.name for c in two] == ["calculator", "python"] and two[1].arguments == {"code": "print(1)"}
    assert fmt.parse("the answer is 6") == []


@pytest.mark.parametrize("text,needle", [
    ("<tool_call>{not json}</tool_call>", "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
    ('<tool_call>{"name": "c", "arguments": [1]}</tool_call>', "not a JSON object"),
    ('<tool_call>{"name": "c", "arguments": {}}', "unbalanced"),
])
def test_hermes_malformed_calls_carry_an_error(text, needle):
    calls = HermesFormat().parse(text)
    assert calls and calls[-1].error is not None and needle in calls[-1].error


def test_render_and_format_registry():
    assert HermesFormat().render(["6"]) == ("\n<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n"
                                            "<|im_start|>assistant\n")
    assert HermesPlainFormat().render(["6", "x"]) == "\nUser: <tool_response>6</tool_response>" \
                                                    "<tool_response>x</tool_response>\nAssistant:"
    with pytest.raises(ValueError, match="rollout.multi_turn.format='nope'.*hermes"):
        get_format("nope")


# -------------------------------------------------------------------------------------------- calculator
@pytest.mark.parametrize("expr,value", [("123 * 456", 56088), ("(1 + 2) ** 3 - -4", 31), ("7 / 2", 3.5),
                                        ("17 // 5 % 3", 0), ("2.5*4", 10.0)])
def test_calculator_arithmetic(expr, value):
    assert safe_arithmetic(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os')", "a + 1", "2 ** 1000", "1 / 0", "[1] * 3", "abs(-1)", "1 +"])
def test_calculator_refuses_everything_else(expr):
    res = CalculatorTool().execute({"expression": expr}, ToolContext("0"))
    assert res.is_error and res.text.startswith("Error:")


@pytest.mark.parametrize("expr", ["((((9**64)**64)**64)**64)", "*".join(["9**64"] * 33), "(9**64)**64 * 3",
                                  " * ".join(["99**64"] * 10), "(-8) ** (1/3)",
                                  "(2**64)**64 / 3", "(3**64)**10.5"])
def test_calculator_refuses_huge_results_before_computing_them(expr):
    # A big-int power or product is one C call holding the GIL: computed, it would stall every tool call's timeout.
    start = time.monotonic()
    res = CalculatorTool().execute({"expression": expr}, ToolContext("0"))
    assert res.is_error and res.text.startswith("Error:") and time.monotonic() - start < 1.0, res


def test_calculator_keeps_large_results_under_the_cap():
    assert safe_arithmetic("99999999999 ** 64") == 99999999999 ** 64
    assert safe_arithmetic("(2**64)**-2") == 2.0 ** -128


def test_calculator_formats_integral_results():
    assert CalculatorTool().execute({"expression": "6 / 2"}, ToolContext("0")).text == "3"
    assert CalculatorTool().execute({}, ToolContext("0")).is_error


# ------------------------------------------------------------------------------------------------ config
def test_load_tools_builtin_and_class_path(tmp_path):
    cfg = tmp_path / "tools.yaml"
    cfg.write_text("tools:\n  - class_name: calculator\n  - class_name: tests.agentic.test_tools.SlowTool\n"
                   "    config: {x: 1}\n    tool_schema:\n      type: function\n      function:\n"
                   "        name: sleeper\n        description: sleeps\n        parameters: {type: object}\n")
    tools = load_tools(cfg)
    assert sorted(tools) == ["calculator", "sleeper"] and tools["sleeper"].config == {"x": 1}
    assert tools["calculator"].schema()["function"]["parameters"]["required"] == ["expression"]


@pytest.mark.parametrize("body,needle", [
    ("tools: []", "top-level `tools:` list"),
    ("tools:\n  - config: {}", "needs `class_name`"),
    ("tools:\n  - class_name: no.such.Module", "cannot import"),
    ("tools:\n  - class_name: builtins.dict", "not a subclass"),
    ("tools:\n  - class_name: calculator\n    confg: {}", "unknown keys"),
    ("tools:\n  - class_name: calculator\n  - class_name: calculator", "already defined"),
])
def test_load_tools_errors_name_the_fix(tmp_path, body, needle):
    cfg = tmp_path / "tools.yaml"
    cfg.write_text(body)
    with pytest.raises(ValueError, match=needle):
        load_tools(cfg)
    with pytest.raises(ValueError, match="rollout.multi_turn.tool_config_path.*no such file"):
        load_tools(tmp_path / "missing.yaml")


# ----------------------------------------------------------------------------------------------- session
def _session(timeout_s=5.0, max_len=8):
    tools = {"calculator": CalculatorTool(), "slow": SlowTool(), "boom": BoomTool()}
    return ToolSession(tools, HermesPlainFormat(), builtin_tokenizer(), max_assistant_turns=3,
                       max_tool_response_length=max_len, tool_timeout_s=timeout_s, tool_workers=2)


def _turn(tok, *calls):
    return tok.encode("".join(f"<tool_call>{c}</tool_call>" for c in calls), add_special_tokens=False)


def _wait(p):
    while not p.ready():
        time.sleep(0.01)


def test_session_runs_calls_and_counts_errors_and_timeouts():
    s, tok = _session(timeout_s=0.3, max_len=100), builtin_tokenizer()
    s.begin([None])
    p = s.on_turn_end(0, _turn(tok, '{"name": "calculator", "arguments": {"expression": "12*12"}}',
                               '{"name": "boom", "arguments": {}}', '{"name": "nope"}', "{bad",
                               '{"name": "slow", "arguments": {"s": 2}}'), turn_complete=True)
    _wait(p)
    text = tok.decode(s.collect(0, p).ids)
    assert text.startswith("\nUser: <tool_response>144</tool_response>") and text.endswith("\nAssistant:")
    assert "RuntimeError: kaput" in text and "unknown tool 'nope'" in text and "timed out" in text
    m = s.metrics()
    assert (m["tool_calls/mean"], m["tool_errors"], m["tool_calls/malformed"], m["tool_timeouts"]) == (5, 4, 1, 1)
    assert m["tool_calls/by_tool/calculator"] == 1 and m["timing/tool"] >= 0
    s.close()


def test_session_ends_trajectory_without_calls_at_turn_limit_or_budget():
    s, tok = _session(), builtin_tokenizer()
    s.begin([None])
    call = _turn(tok, '{"name": "calculator", "arguments": {"expression": "1"}}')
    assert s.on_turn_end(0, tok.encode("42", add_special_tokens=False), True) is None
    assert s.on_turn_end(0, call, turn_complete=False) is None  # cut by the budget: no tool runs
    assert s.on_turn_end(0, call, True) is None  # third turn = max_assistant_turns
    assert s.metrics()["num_turns/max"] == 3


def test_tool_response_is_cut_to_max_tool_response_length():
    s, tok = _session(), builtin_tokenizer()
    s.begin([None])
    p = s.on_turn_end(0, _turn(tok, '{"name": "calculator", "arguments": {"expression": "7**40"}}'), True)
    _wait(p)
    assert tok.decode(s.collect(0, p).ids) == "\nUser: <tool_response>" + str(7**40)[:8] + "...</tool_response>\nAssistant:"


# ------------------------------------------------------------------------------------------- config keys
def test_multi_turn_config_is_off_by_default_and_validated():
    from hybridflow.config import load_config

    assert load_config([], []).rollout.multi_turn.enable is False
    with pytest.raises(ValueError, match="rollout.multi_turn.max_assistant_turns=0"):
        load_config([], ["rollout.multi_turn.max_assistant_turns=0"])
    with pytest.raises(ValueError, match="rollout.multi_turn.enable.*rollout.name=hybrid"):
        load_config([], ["rollout.multi_turn.enable=true", "rollout.name=hf"])
    mt = load_config([], ["rollout.multi_turn.enable=true"]).rollout.multi_turn
    with pytest.raises(ValueError, match="no tools and no interaction.*rollout.multi_turn.tools"):
        ToolSession.from_config(mt, builtin_tokenizer())
    with pytest.raises(ValueError, match="unknown built-in tool 'calc'"):
        ToolSession.from_config(load_config([], ["rollout.multi_turn.tools=[calc]"]).rollout.multi_turn,
                                builtin_tokenizer())


def test_python_tool_runs_in_the_sandbox():
    from hybridflow import sandbox
    from hybridflow.agentic.tools import PythonTool

    if not any(sandbox.available(m) for m in sandbox.ISOLATED_MODES):
        pytest.skip("no sandbox mode works on this host (tests/rewards/test_sandbox.py covers the refusal)")
    ok = PythonTool({"timeout_s": 10}).execute({"code": "print(6 * 7)"}, ToolContext("0"))
    assert (ok.text.strip(), ok.is_error) == ("42", False)
    bad = PythonTool({"timeout_s": 10}).execute({"code": "raise SystemExit(3)"}, ToolContext("0"))
    assert bad.is_error and "exit 3" in bad.text
    leak = PythonTool({"timeout_s": 10}).execute({"code": "import os; print(os.path.exists('/work'))"},
                                                ToolContext("0"))
    assert leak.text.strip() == "False"
