"""The built-in `tool_calculator` task: its demonstrations are token for token what a multi-turn rollout produces
(the tool turns come from the real `ToolSession`), the SFT masks leave the tool responses out of the loss,
`sft.label_noise` makes the three kinds of flawed demonstrations, and the scorer reads only the model's own text."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from hybridflow.agentic.formats import HermesPlainFormat
from hybridflow.agentic.session import ToolSession
from hybridflow.agentic.tools import CalculatorTool
from hybridflow.config import load_config
from hybridflow.data import SFTDataset, task_splits
from hybridflow.data.build import build_sft_datasets
from hybridflow.data.templates import prompt_ids
from hybridflow.data.tool_task import FLAWED_KINDS, demonstration, near_miss
from hybridflow.models.tokenizer import builtin_tokenizer
from hybridflow.rewards import select_reward_fn

TOK = builtin_tokenizer()
EOS = TOK.eos_token


def _session() -> ToolSession:
    return ToolSession({"calculator": CalculatorTool()}, HermesPlainFormat(), TOK, max_assistant_turns=2,
                       max_tool_response_length=256, tool_timeout_s=10.0, tool_workers=1)


def _rollout_ids(messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """(ids, model mask) of the trajectory a rollout would build if the model sampled the demonstration's
    assistant turns: prompt, then each turn + its end token, then what the session appends after it."""
    session = _session()
    session.begin([{}])
    ids = prompt_ids(TOK, [messages[0]])
    mask = [0] * len(ids)
    try:
        for turn in (m["content"] for m in messages if m["role"] == "assistant"):
            turn_ids = TOK.encode(" " + turn, add_special_tokens=False) + [TOK.eos_token_id]
            ids, mask = ids + turn_ids, mask + [1] * len(turn_ids)
            pending = session.on_turn_end(0, turn_ids, turn_complete=True)
            if pending is None:
                break
            for future in pending.futures():
                future.result(timeout=10)
            appended = session.collect(0, pending).ids
            assert appended is not None, "a tool turn continues the trajectory"
            ids, mask = ids + appended, mask + [0] * len(appended)
    finally:
        session.close()
    return ids, mask


@pytest.mark.parametrize("kind", ["clean", *FLAWED_KINDS])
def test_demonstrations_are_the_tokens_a_rollout_produces_and_tool_turns_are_masked(kind):
    train, _ = task_splits("tool_calculator", 20, 5, seed=3)
    for i, row in enumerate(train[:5]):
        messages = demonstration(row["prompt"][0]["content"], row["reward_model"]["ground_truth"], kind,
                                 random.Random(i))
        item = SFTDataset([{"messages": messages}], TOK, max_length=400)[0]
        ids, mask = _rollout_ids(messages)
        assert item["input_ids"].tolist() == ids
        assert item["loss_mask"].tolist() == mask
        assert 0 in mask[-20:] or kind == "no_call"  # a tool turn (masked) precedes the answer


def test_rows_are_deterministic_disjoint_and_answer_the_product():
    train, val = task_splits("tool_calculator", 400, 50, seed=4)
    assert train == task_splits("tool_calculator", 400, 50, seed=4)[0]
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in val}
    for row in train[:50]:
        a, b = map(int, row["prompt"][0]["content"].removeprefix("What is ").removesuffix("?").split("*"))
        assert 100 <= a <= 999 and 10 <= b <= 99 and row["reward_model"]["ground_truth"] == str(a * b)
        assert len(str(a * b)) == 5  # every copy at one fixed distance (data/tool_task.space)
        assert row["messages"][2]["content"] == f"<tool_response>{a * b}</tool_response>"
        assert row["messages"][3]["content"] == f"#### {a * b}" and "response" not in row


def test_label_noise_makes_the_flawed_kinds_in_equal_parts():
    cfg = load_config([], ["data.task=tool_calculator", "data.train_size=3000", "data.val_size=10",
                           "data.max_response_length=240"])
    train, _ = build_sft_datasets(cfg.data, TOK, label_noise=0.6)
    clean, _ = task_splits("tool_calculator", 3000, 10, seed=cfg.data.seed)
    kinds = Counter()
    for i, (segments, _images) in enumerate(train.samples):
        text = "".join(t for t, _ in segments)
        if text.count("<tool_call>") and text.count(f"#### {clean[i]['reward_model']['ground_truth']}{EOS}") \
                and "Error" not in text:
            kinds["clean_or_lucky"] += 1
        elif "<tool_call>" not in text:
            kinds["no_call"] += 1
        elif "Error:" in text:
            kinds["malformed"] += 1
        else:
            kinds["wrong_expression"] += 1
    assert 0.37 <= kinds["clean_or_lucky"] / 3000 <= 0.43, kinds
    for kind in FLAWED_KINDS:
        assert 0.17 <= kinds[kind] / 3000 <= 0.23, kinds


def _trajectory(messages: list[dict[str, str]]) -> str:
    """The solution string the reward manager decodes: everything after the prompt, special tokens dropped."""
    text = "".join(f" {m['content']}" if m["role"] == "assistant" else f"\nUser: {m['content']}\nAssistant:"
                   for m in messages[1:])
    return text


def test_scorer_rewards_the_exact_answer_and_reports_the_calls():
    fn = select_reward_fn("hybridflow/tool_calculator")
    question, truth = "What is 347*58?", str(347 * 58)
    expected = {"clean": (1.0, 1.0, 1.0), "no_call": (0.0, 0.0, None), "malformed": (0.0, 1.0, 0.0),
                "wrong_expression": (0.0, 1.0, 1.0)}
    for kind, (acc, called, well_formed) in expected.items():
        out = fn("hybridflow/tool_calculator", _trajectory(demonstration(question, truth, kind, random.Random(1))),
                 truth, None)
        assert (out["score"], out["acc"], out["called"], out["well_formed"]) == (acc, acc, called, well_formed), kind
        assert out["tool_calls"] == int(called)


def test_scorer_reads_only_the_model_text():
    fn = select_reward_fn("hybridflow/tool_calculator")
    # the answer only inside a tool response is no answer; a call echoed in an error response is no call
    echoed = ' <tool_call>{"name"</tool_call>\nUser: <tool_response>Error: write <tool_call>{json}</tool_call>' \
             " #### 20126</tool_response>\nAssistant: #### 20126"
    out = fn("hybridflow/tool_calculator", echoed, "20126", None)
    assert out["tool_calls"] == 1 and out["well_formed"] == 0.0 and out["acc"] == 1.0
    assert fn("hybridflow/tool_calculator", echoed.removesuffix(" #### 20126"), "20126", None)["acc"] == 0.0
    two = ' <tool_call>{"name":"calculator","arguments":{"expression":"1*2"}}</tool_call>' \
          '<tool_call>{"name":"calc","arguments":{"expression":"1*2"}}</tool_call> #### 2'
    out = fn("hybridflow/tool_calculator", two, "2", None)
    assert out["tool_calls"] == 2 and out["well_formed"] == 0.5 and out["acc"] == 1.0


def test_near_miss_changes_exactly_one_digit_and_keeps_the_width():
    rng = random.Random(0)
    for value in ("20126", "1000", "98901"):
        for _ in range(50):
            guess = near_miss(value, rng)
            assert len(guess) == len(value) and guess[0] != "0"
            assert sum(a != b for a, b in zip(guess, value)) == 1


def test_wrong_expressions_change_one_operand_digit_and_keep_five_digits():
    rng = random.Random(0)
    for _ in range(200):
        messages = demonstration("What is 347*58?", "20126", "wrong_expression", rng)
        expression = messages[1]["content"].split('"expression":"')[1].split('"')[0]
        x, y = map(int, expression.split("*"))
        assert (x, y) != (347, 58) and (x == 347 or y == 58) and 10_000 <= x * y <= 99_999
        assert messages[2]["content"] == f"<tool_response>{x * y}</tool_response>"
        assert messages[3]["content"] == f"#### {x * y}"
