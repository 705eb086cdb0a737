"""Interactions (simulated users / games): YAML loading, the built-in guessing game, the session's user turns,
limits and per-turn rewards, and the chat-template deltas that user and tool turns are appended with."""

from __future__ import annotations

import copy
import time

import pytest

from hybridflow.agentic.chat_delta import ChatDelta
from hybridflow.agentic.formats import HermesPlainFormat, HermesTemplateFormat
from hybridflow.agentic.interactions import (
    GuessNumberInteraction,
    Interaction,
    InteractionStep,
    load_interactions,
)
from hybridflow.agentic.session import ToolSession
from hybridflow.agentic.tools import CalculatorTool
from hybridflow.models.tokenizer import EOS, builtin_tokenizer

TOK = builtin_tokenizer()


def _chatml_tokenizer():
    """The built-in character tokenizer plus ChatML's two special tokens (built locally, nothing downloaded)."""
    tok = copy.deepcopy(builtin_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return tok


# ChatML (Qwen2.5's layout without its tool block), rendered with the built-in character tokenizer
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


class Exploding(Interaction):
    def step(self, assistant_message):
        raise KeyError("oops")


class Sleepy(Interaction):
    def step(self, assistant_message):
        time.sleep(1.0)
        return InteractionStep("late", 5.0)


class TupleUser(Interaction):
    def step(self, assistant_message):
        return ("again", 0.25, False)


def _ids(text):
    return TOK.encode(text, add_special_tokens=False)


def _wait(p):
    while not p.ready():
        time.sleep(0.01)


def _session(tmp_path, body, *, tools=None, max_user_turns=3, max_turns=5, timeout_s=5.0, chat_template=None,
             fmt=None):
    cfg = tmp_path / "interaction.yaml"
    cfg.write_text(body)
    return ToolSession(tools or {}, fmt or HermesPlainFormat(), TOK, max_assistant_turns=max_turns,
                       max_tool_response_length=64, tool_timeout_s=timeout_s, tool_workers=2,
                       interactions=load_interactions(cfg), max_user_turns=max_user_turns,
                       chat_template=chat_template)


GUESS = "interaction:\n  - class_name: guess_number\n"


# ------------------------------------------------------------------------------------------------ loading
@pytest.mark.parametrize("body,needle", [
    ("interaction: []", "top-level `interaction:` list"),
    ("interaction:\n  - config: {}", "needs `class_name`"),
    ("interaction:\n  - class_name: no.such.Thing", "cannot import"),
    ("interaction:\n  - class_name: builtins.dict\n    name: d", "not a subclass"),
    ("interaction:\n  - class_name: tests.agentic.test_interactions.TupleUser", "give a `name`"),
    ("interaction:\n  - class_name: guess_number\n    cfg: {}", "unknown keys"),
    ("interaction:\n  - class_name: guess_number\n  - class_name: guess_number", "already defined"),
    ("interaction:\n  - class_name: guess_number\n    config: [1]", "`config` must be a mapping"),
])
def test_load_interactions_errors_name_the_fix(tmp_path, body, needle):
    cfg = tmp_path / "i.yaml"
    cfg.write_text(body)
    with pytest.raises(ValueError, match=needle):
        load_interactions(cfg)
    with pytest.raises(ValueError, match="rollout.multi_turn.interaction_config_path.*no such file"):
        load_interactions(tmp_path / "missing.yaml")


def test_rows_pick_their_interaction_by_name(tmp_path):
    s = _session(tmp_path, GUESS + "  - name: user\n    class_name: tests.agentic.test_interactions.TupleUser\n")
    first = s.begin([{"interaction_kwargs": {"name": "guess_number", "secret": 7}},
                     {"interaction_kwargs": {"name": "user"}}])
    assert first == ["I picked a number from 1 to 100. Guess it.", None]
    assert isinstance(s.envs[0], GuessNumberInteraction) and type(s.envs[1]).__name__ == "TupleUser"
    with pytest.raises(ValueError, match="several interactions.*interaction_kwargs.name"):
        s.begin([{}])
    with pytest.raises(ValueError, match="name='nope' is not in rollout.multi_turn.interaction_config_path"):
        s.begin([{"interaction_kwargs": {"name": "nope"}}])
    with pytest.raises(ValueError, match="interaction_kwargs must be a dict"):
        s.begin([{"interaction_kwargs": "secret=3"}])


# ------------------------------------------------------------------------------------------ guessing game
def test_guess_number_game():
    g = GuessNumberInteraction({"hit_reward": 2.0})
    with pytest.raises(ValueError, match="interaction_kwargs needs `secret`"):
        g.reset({})
    assert g.reset({"secret": 42, "low": 10, "high": 50}) == "I picked a number from 10 to 50. Guess it."
    assert g.step("maybe 30?") == InteractionStep("Higher.", 0.0)
    assert g.step("20 then 60") == InteractionStep("Lower.", 0.0)
    assert g.step("no idea") == InteractionStep("Say a number.", 0.0)
    assert g.step("it is 42") == InteractionStep("Correct!", 2.0, done=True)
    assert GuessNumberInteraction({"intro": False}).reset({"secret": 1}) is None


# --------------------------------------------------------------------------------------------- session
def test_user_turns_rewards_and_done(tmp_path):
    s = _session(tmp_path, GUESS)
    assert s.begin([{"interaction_kwargs": {"secret": 42}}]) == ["I picked a number from 1 to 100. Guess it."]
    turn = _ids(" 30") + [TOK.convert_tokens_to_ids(EOS)]
    p = s.on_turn_end(0, turn, turn_complete=True)
    _wait(p)
    res = s.collect(0, p)
    # the user's reply is the template's delta after the EOS-closed turn: exactly the plain template's text
    assert TOK.decode(res.ids, skip_special_tokens=False) == "\nUser: Higher.\nAssistant:" and res.reward == 0.0
    p = s.on_turn_end(0, _ids(" 42") + [TOK.convert_tokens_to_ids(EOS)], turn_complete=True)
    _wait(p)
    res = s.collect(0, p)
    assert res.ids is None and res.reward == 1.0  # solved: the trajectory ends on the model's turn
    m = s.metrics()
    assert (m["num_user_turns/max"], m["interaction_reward/mean"], m["num_turns/max"]) == (1, 1.0, 2)


def test_max_user_turns_still_scores_the_last_turn(tmp_path):
    s = _session(tmp_path, GUESS, max_user_turns=1)
    s.begin([{"interaction_kwargs": {"secret": 5}}])
    p = s.on_turn_end(0, _ids(" 1"), True)
    _wait(p)
    assert s.collect(0, p).ids is not None
    p = s.on_turn_end(0, _ids(" 5"), True)  # the user-turn budget is spent, but the guess is still judged
    _wait(p)
    res = s.collect(0, p)
    assert res.ids is None and res.reward == 1.0
    s2 = _session(tmp_path, GUESS, max_user_turns=1)
    s2.begin([{"interaction_kwargs": {"secret": 5}}])
    for guess, expect_ids in ((" 1", True), (" 2", False)):
        p = s2.on_turn_end(0, _ids(guess), True)
        _wait(p)
        res = s2.collect(0, p)
        assert (res.ids is not None) == expect_ids and res.reward == 0.0
    assert s2.metrics()["num_user_turns/max"] == 1
    assert s2.on_turn_end(0, _ids(" 3"), turn_complete=False) is None  # cut by the budget: not judged


def test_tool_calls_go_to_tools_and_plain_turns_to_the_interaction(tmp_path):
    s = _session(tmp_path, "interaction:\n  - name: u\n    class_name: tests.agentic.test_interactions.TupleUser\n",
                 tools={"calculator": CalculatorTool()})
    s.begin([{}])
    p = s.on_turn_end(0, _ids('<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'),
                      True)
    _wait(p)
    assert "<tool_response>4</tool_response>" in TOK.decode(s.collect(0, p).ids)
    p = s.on_turn_end(0, _ids("done"), True)
    _wait(p)
    res = s.collect(0, p)  # a tuple (observation, reward, done) is accepted
    assert TOK.decode(res.ids, skip_special_tokens=False) == "<|endoftext|>\nUser: again\nAssistant:"
    assert res.reward == 0.25


def test_interaction_errors_and_timeouts(tmp_path):
    s = _session(tmp_path, "interaction:\n  - name: x\n    class_name: tests.agentic.test_interactions.Exploding\n")
    s.begin([{}])
    p = s.on_turn_end(0, _ids("hi"), True)
    _wait(p)
    with pytest.raises(RuntimeError, match="Exploding.step raised on row 0: KeyError"):
        s.collect(0, p)
    s = _session(tmp_path, "interaction:\n  - name: x\n    class_name: tests.agentic.test_interactions.Sleepy\n",
                 timeout_s=0.2)
    s.begin([{}])
    p = s.on_turn_end(0, _ids("hi"), True)
    _wait(p)
    res = s.collect(0, p)
    assert res.ids is None and res.reward == 0.0 and s.metrics()["interaction_timeouts"] == 1


# ------------------------------------------------------------------------------------------- chat deltas
def test_chat_delta_chatml_turns_and_first_message():
    tok = _chatml_tokenizer()
    d = ChatDelta(tok, CHATML)
    assert d.end_marker() == "<|im_end|>\n"
    (im_end,) = tok.encode("<|im_end|>", add_special_tokens=False)
    user = [{"role": "user", "content": "Lower."}]
    # the model closed its turn with <|im_end|>: only the rest of the template's text is appended
    got = d.after_turn(user, im_end)
    assert tok.decode(got) == "\n<|im_start|>user\nLower.<|im_end|>\n<|im_start|>assistant\n"
    assert got.count(im_end) == 1  # special tokens come out as their single ids
    # a turn that stopped on another token (EOS) is closed by the template's end text first
    eos = tok.convert_tokens_to_ids(EOS)
    assert tok.decode(d.after_turn(user, eos)) == "<|im_end|>" + tok.decode(got)
    prompt = tok.encode("<|im_start|>user\nplay<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    ext = d.after_prompt([{"role": "user", "content": "Guess."}], prompt)
    assert ext[: len(prompt) - 12] == prompt[:-12]  # the prompt's ids are kept; only its generation prompt moves
    assert tok.decode(ext) == ("<|im_start|>user\nplay<|im_end|>\n<|im_start|>user\nGuess.<|im_end|>\n"
                               "<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="does not end with the chat template's generation prompt"):
        d.after_prompt([{"role": "user", "content": "x"}], _ids("no generation prompt"))


def test_chat_delta_equals_rendering_the_whole_conversation():
    """Appending deltas turn by turn gives the ids of the template applied to the whole conversation."""
    d = ChatDelta(TOK)  # the built-in plain template
    msgs = [{"role": "user", "content": "q"}]
    seq = _ids(TOK.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    for answer, reply in ((" a1", "r1"), (" a2", "r2")):
        seq += _ids(answer) + [TOK.convert_tokens_to_ids(EOS)]
        seq += d.after_turn([{"role": "user", "content": reply}], seq[-1])
        # the plain template writes "Assistant: " + content; the model wrote the space after "Assistant:"
        msgs += [{"role": "assistant", "content": answer.lstrip()}, {"role": "user", "content": reply}]
    whole = TOK.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert TOK.decode(seq, skip_special_tokens=False) == whole


def test_chat_delta_refuses_a_template_that_is_not_prefix_stable():
    odd = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="prefix of its continuation"):
        ChatDelta(TOK, odd).after_turn([{"role": "user", "content": "x"}], None)


def test_hermes_template_format_writes_tool_messages_through_the_template(tmp_path):
    tool_tpl = CHATML.replace("m['role']", "('user' if m['role'] == 'tool' else m['role'])").replace(
        "m['content']", "(('<tool_response>' + m['content'] + '</tool_response>') if m['role'] == 'tool' "
                        "else m['content'])")
    tok = _chatml_tokenizer()
    s = ToolSession({"calculator": CalculatorTool()}, HermesTemplateFormat(), tok, max_assistant_turns=3,
                    max_tool_response_length=64, tool_timeout_s=5.0, tool_workers=1, chat_template=tool_tpl)
    s.begin([None])
    turn = tok.encode('<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
                      "<|im_end|>", add_special_tokens=False)
    p = s.on_turn_end(0, turn, True)
    _wait(p)
    assert tok.decode(s.collect(0, p).ids) == ("\n<|im_start|>user\n<tool_response>42</tool_response>"
                                               "<|im_end|>\n<|im_start|>assistant\n")
