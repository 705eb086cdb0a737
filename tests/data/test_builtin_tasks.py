"""Built-in tasks (deterministic, disjoint, scored correctly) and the SFT / preference datasets."""

from __future__ import annotations

import re

import pytest
import torch

from hybridflow.data import PreferenceDataset, SFTDataset, StatefulDataLoader, task_splits
from hybridflow.models.tokenizer import builtin_tokenizer
from hybridflow.rewards import select_reward_fn

TOK = builtin_tokenizer()


@pytest.mark.parametrize("task", ["arithmetic", "sort"])
def test_tasks_are_deterministic_and_disjoint(task):
    train, val = task_splits(task, 500, 100, seed=4)
    again, _ = task_splits(task, 500, 100, seed=4)
    other, _ = task_splits(task, 500, 100, seed=5)
    assert train == again and train != other
    questions = lambda rows: {r["prompt"][0]["content"] for r in rows}  # noqa: E731
    assert len(questions(val)) == 100 and not questions(train) & questions(val)
    assert {r["data_source"] for r in train} == {f"hybridflow/{task}"}


def test_train_repeats_only_when_asked_for_more_than_exist_and_stays_disjoint():
    train, val = task_splits("arithmetic", 10_500, 100, seed=0)
    assert len(train) == 10_500
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in val}


def test_arithmetic_rows_are_small_and_correct():
    train, _ = task_splits("arithmetic", 50, 5, seed=1)
    for row in train:
        a, b = map(int, row["prompt"][0]["content"].split("What is ")[1].split("?")[0].split("+"))
        assert row["reward_model"]["ground_truth"] == str(a + b)
        assert row["response"] == f"#### {a + b}" and len(row["response"]) <= 8
        assert re.fullmatch(r"What is \d\d\+\d\d\?", row["prompt"][0]["content"])  # operands zero-padded


@pytest.mark.parametrize("task", ["arithmetic", "sort"])
def test_scorers_accept_the_sft_answer_and_reject_others(task):
    train, _ = task_splits(task, 30, 5, seed=2)
    for row in train:
        fn = select_reward_fn(row["data_source"])
        truth = row["reward_model"]["ground_truth"]

        def score(text: str, fn=fn, row=row, truth=truth) -> float:
            out = fn(row["data_source"], text, truth, row["extra_info"])
            return out["acc"] if isinstance(out, dict) else out  # arithmetic also reports partial credit

        assert score(row["response"]) == 1.0
        assert score("#### 999") == 0.0
        assert score(truth) == 0.0  # no "####": no credit
    if task == "sort":
        assert fn("hybridflow/sort", "####  0  1 2 3", "0 1 2 3", None) == 1.0


def test_sft_dataset_masks_exactly_the_response_and_eos():
    train, _ = task_splits("arithmetic", 6, 2, seed=1)
    ds = SFTDataset(train, TOK, max_length=96)
    batch = StatefulDataLoader(ds, 6, shuffle=False).__iter__().__next__()
    for i, row in enumerate(train):
        ids, mask, loss = (batch.batch[k][i] for k in ("input_ids", "attention_mask", "loss_mask"))
        text = TOK.decode(ids[mask.bool()])
        prompt = f"User: {row['prompt'][0]['content']}\nAssistant:"
        assert text == prompt + row["response"] + TOK.eos_token
        assert TOK.decode(ids[loss.bool()]) == row["response"] + TOK.eos_token
        assert int(loss.sum()) == len(row["response"]) + 1 and not bool((loss.bool() & ~mask.bool()).any())


def test_sft_messages_rows_train_on_every_assistant_turn():
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                        {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}]}
    ds = SFTDataset([row], TOK, max_length=200)
    item = ds[0]
    eos = TOK.eos_token
    assert TOK.decode(item["input_ids"]) == f"User: hi\nAssistant: yo{eos}\nUser: again\nAssistant: ok{eos}"
    assert TOK.decode(item["input_ids"][item["loss_mask"].bool()]) == f" yo{eos} ok{eos}"
    assert len(SFTDataset([row], TOK, max_length=10)[0]["input_ids"]) == 10


def test_sft_bad_rows_skipped_or_strict():
    rows = [{"prompt": "q", "response": "a"}, {"prompt": "q"}, {"messages": [{"role": "user", "content": "x"}]}]
    assert len(SFTDataset(rows, TOK, max_length=50)) == 1
    with pytest.raises(ValueError, match="row 1 is malformed"):
        SFTDataset(rows, TOK, max_length=50, strict=True)


def test_preference_dataset_pairs_right_padded():
    rows = [{"prompt": "2+2?", "chosen": "4", "rejected": "five"},
            {"prompt": [{"role": "user", "content": "1+1?"}], "chosen": [{"role": "assistant", "content": "2"}],
             "rejected": "3"}]
    ds = PreferenceDataset(rows, TOK, max_length=64)
    batch = StatefulDataLoader(ds, 2, shuffle=False).__iter__().__next__()
    assert batch.batch["chosen_input_ids"].shape == batch.batch["rejected_input_ids"].shape
    eos = TOK.eos_token
    for side, want in (("chosen", ["4", "2"]), ("rejected", ["five", "3"])):
        ids, mask = batch.batch[f"{side}_input_ids"], batch.batch[f"{side}_attention_mask"]
        for i, prompt in enumerate(["2+2?", "1+1?"]):
            assert TOK.decode(ids[i][mask[i].bool()]) == f"User: {prompt}\nAssistant:{want[i]}{eos}"
            last = int(mask[i].sum()) - 1  # right padding: the scored EOS is at sum(mask) - 1
            assert int(ids[i][last]) == TOK.eos_token_id and bool(mask[i][: last + 1].all())
    assert torch.equal(batch.batch["chosen_position_ids"][0][:3], torch.arange(3))
