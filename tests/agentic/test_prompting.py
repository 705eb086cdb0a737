"""Tools offered through `apply_chat_template(tools=...)` when the template reads `tools` (a tiny template built
here, nothing downloaded), the fallback without it, and trajectories split into turns for validation logs."""

from __future__ import annotations

import dataclasses
import logging

import torch

from hybridflow.agentic.prompting import prompt_tools, template_reads_tools
from hybridflow.agentic.tools import CalculatorTool
from hybridflow.agentic.trajectory import decoded_turns, format_turns, split_turns
from hybridflow.config import load_config
from hybridflow.data import RLHFDataset
from hybridflow.models.tokenizer import CHAT_TEMPLATE, builtin_tokenizer
from hybridflow.protocol import DataProto

TOK = builtin_tokenizer()
# A template in the style of Qwen2.5's: tool schemas as JSON in a system block when `tools` is given.
TOOLS_TEMPLATE = (
    "{% if tools %}{{ 'Tools:' }}{% for t in tools %}{{ ' ' + t['function']['name'] + '(' + "
    "(t['function']['parameters']['required'] | join(',')) + ')' }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
)
ROWS = [{"data_source": "t", "prompt": [{"role": "user", "content": "2*3?"}],
         "reward_model": {"style": "rule", "ground_truth": "6"}}]


def _mt(**kw):
    mt = load_config([], ["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]"]).rollout.multi_turn
    return dataclasses.replace(mt, **kw)


def test_template_reads_tools():
    assert template_reads_tools(TOOLS_TEMPLATE)
    assert not template_reads_tools(CHAT_TEMPLATE)


def test_tools_reach_the_prompt_through_the_template():
    schemas = prompt_tools(_mt(), TOK, TOOLS_TEMPLATE)
    assert schemas == [CalculatorTool().schema()]
    ds = RLHFDataset(ROWS, TOK, max_prompt_length=64, chat_template=TOOLS_TEMPLATE, tools=schemas)
    assert TOK.decode(ds[0]["input_ids"]) == "Tools: calculator(expression)\nuser: 2*3?\nassistant:"
    plain = RLHFDataset(ROWS, TOK, max_prompt_length=64, chat_template=TOOLS_TEMPLATE)
    assert TOK.decode(plain[0]["input_ids"]) == "user: 2*3?\nassistant:"


def test_no_tools_offered_without_template_support_or_when_off(caplog):
    with caplog.at_level(logging.INFO, logger="hybridflow.agentic.prompting"):
        assert prompt_tools(_mt(), TOK, None) is None  # the built-in plain template has no `tools`
    assert "no `tools` variable" in caplog.text
    assert prompt_tools(_mt(offer_tools_in_prompt=False), TOK, TOOLS_TEMPLATE) is None
    assert prompt_tools(_mt(enable=False), TOK, TOOLS_TEMPLATE) is None
    assert prompt_tools(_mt(tools=[]), TOK, TOOLS_TEMPLATE) is None


def test_split_turns_and_decoded_turns():
    ids = TOK.encode("ab|x|cd", add_special_tokens=False)
    mask = [1, 1, 0, 0, 0, 1, 1]
    assert split_turns(ids, mask) == [("assistant", ids[:2]), ("context", ids[2:5]), ("assistant", ids[5:])]
    assert decoded_turns(TOK, ids, mask) == [{"role": "assistant", "text": "ab"}, {"role": "context", "text": "|x|"},
                                             {"role": "assistant", "text": "cd"}]


def test_validation_samples_show_every_turn():
    from hybridflow.trainer.validation import Validator

    prompt = TOK.encode("User: q\nAssistant:", add_special_tokens=False)
    a1, ctx, a2 = (TOK.encode(t, add_special_tokens=False) for t in (" 30", "\nUser: Higher.\nAssistant:", " 42"))
    resp, model = a1 + ctx + a2, [1] * len(a1) + [0] * len(ctx) + [1] * len(a2)
    R = len(resp) + 4
    out = DataProto.from_single_dict({
        "prompts": torch.tensor([prompt]),
        "responses": torch.tensor([resp + [0] * 4]),
        "response_mask": torch.tensor([model + [0] * 4]),
        "attention_mask": torch.tensor([[1] * len(prompt) + [1] * len(resp) + [0] * 4]),
    })
    assert out.batch["responses"].shape[1] == R

    class V(Validator):
        def __init__(self):
            self.cfg = load_config([], ["trainer.log_val_generations=1"])
            self.reward_fn = type("RF", (), {"tokenizer": TOK})()

    (s,) = V()._samples(out, [1.0])
    assert s["response"] == " 30\nUser: Higher.\nAssistant: 42"
    assert [t["role"] for t in s["turns"]] == ["assistant", "context", "assistant"]
    assert s["turns"][1]["text"] == "\nUser: Higher.\nAssistant:"
    assert format_turns(s["turns"]) == ("  [assistant] ' 30'\n  [context] '\\nUser: Higher.\\nAssistant:'\n"
                                        "  [assistant] ' 42'")
