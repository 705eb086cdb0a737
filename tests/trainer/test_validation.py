"""Validator with a scripted actor (answers from each row's extra_info) and the real RewardManager: failed rewards
are counted and left out of `val/reward`, an all-failed batch warns and records an event, and accuracy is the
scorer's `acc` when it gives one, else score >= `reward.success_threshold`."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch

from hybridflow.config import load_config
from hybridflow.data import RLHFDataset
from hybridflow.models.tokenizer import builtin_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.rewards import RewardManager
from hybridflow.trainer.validation import Validator

TOK = builtin_tokenizer()
R = 16
# "raise" fails; "near" is partial credit without `acc`; "#### 1" exact; "accfalse" scores 1.0 but says acc=0.
PARTIAL = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if "raise" in solution_str:
        raise RuntimeError("scorer bug")
    if "accfalse" in solution_str:
        return {"score": 1.0, "acc": False}
    if "near" in solution_str:
        return 0.5
    return float(solution_str.strip() == "#### " + str(ground_truth))
"""


class ScriptedActor:
    """Stands in for the actor group: the response of each row is its `extra_info["answer"]`."""

    def generate_sequences(self, batch: DataProto) -> DataProto:
        answers = [e["answer"] for e in batch.non_tensor_batch["extra_info"]]
        resp = torch.full((len(answers), R), TOK.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(resp)
        for i, text in enumerate(answers):
            ids = TOK(text, add_special_tokens=False)["input_ids"][:R]
            resp[i, : len(ids)], mask[i, : len(ids)] = torch.tensor(ids), 1
        return DataProto.from_dict({"prompts": batch.batch["input_ids"], "responses": resp, "response_mask": mask},
                                   dict(batch.non_tensor_batch))


class RecordingTracker:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def event(self, kind: str, message: str, step: int, level: str = "info", **data: Any) -> None:
        self.events.append({"kind": kind, "message": message, "step": step, "level": level, **data})


def _validate(tmp_path, answers: list[str], sources: list[str] | None = None, *overrides: str,
              tracker: Any = None) -> dict[str, float]:
    path = tmp_path / "partial.py"
    path.write_text(PARTIAL)
    cfg = load_config([], ["reward.num_workers=0", "reward.error_score=-1.0", f"reward.custom.path={path}",
                           "reward.sources=[{name: custom, weight: 1.0}]", *overrides])
    sources = sources or ["my/task"] * len(answers)
    rows = [{"data_source": s, "prompt": f"q{i}", "reward_model": {"ground_truth": "1"},
             "extra_info": {"answer": a}} for i, (a, s) in enumerate(zip(answers, sources))]
    val_ds = RLHFDataset(rows, TOK, max_prompt_length=32, name="val")
    with RewardManager(cfg.reward, TOK, R) as reward_fn:
        return Validator(cfg, val_ds, ScriptedActor(), reward_fn, tracker=tracker).run(step=3)


def test_failed_rewards_are_counted_and_left_out_of_val_reward(tmp_path):
    metrics = _validate(tmp_path, ["#### 1", "raise", "near", "raise"], ["a", "a", "b", "b"])
    assert metrics["val/reward/errors"] == 2 and metrics["val/reward/timeouts"] == 0
    assert metrics["val/reward"] == pytest.approx((1.0 + 0.5) / 2)  # not (1 + 0.5 - 1 - 1) / 4
    assert metrics["val/a/reward"] == 1.0 and metrics["val/b/reward"] == 0.5
    assert metrics["val/accuracy"] == 0.25  # a failed row is not correct
    assert metrics["val/a/accuracy"] == 0.5 and metrics["val/b/accuracy"] == 0.0


def test_a_batch_where_every_reward_failed_warns_and_records_an_event(tmp_path, caplog):
    tracker = RecordingTracker()
    with caplog.at_level(logging.WARNING):
        metrics = _validate(tmp_path, ["raise", "raise", "#### 1", "near"], None, "data.val_batch_size=2",
                            tracker=tracker)
    assert metrics["val/reward/errors"] == 2 and metrics["val/reward"] == pytest.approx(0.75)
    assert [e["kind"] for e in tracker.events] == ["val_reward_failed"]
    assert tracker.events[0]["batches"] == [0] and tracker.events[0]["level"] == "warning"
    assert "every response failed to score in 1 of 2 batches" in caplog.text

    tracker = RecordingTracker()
    metrics = _validate(tmp_path, ["raise"] * 3, None, tracker=tracker)
    assert "val/reward" not in metrics  # no score to average: the error score is not reported as one
    assert metrics["val/reward/errors"] == 3 and metrics["val/accuracy"] == 0.0
    assert tracker.events[0]["responses"] == 3


def test_accuracy_is_acc_when_given_else_score_at_least_the_threshold(tmp_path):
    metrics = _validate(tmp_path, ["#### 1", "near", "near", "near", "#### 2", "accfalse"])
    assert metrics["val/accuracy"] == pytest.approx(1 / 6)  # partial credit (0.5 > 0) is not success
    assert metrics["val/reward"] == pytest.approx((1 + 0.5 * 3 + 0 + 1) / 6)
    lenient = _validate(tmp_path, ["#### 1", "near", "#### 2"], None, "reward.success_threshold=0.5")
    assert lenient["val/accuracy"] == pytest.approx(2 / 3)


def test_builtin_arithmetic_accuracy_stays_exact_match(tmp_path):
    cfg = load_config([], ["reward.num_workers=0"])
    answers = ["#### 152", "#### 150", "#### 153", "no answer"]  # exact, two near misses (partial score), none
    rows = [{"data_source": "hybridflow/arithmetic", "prompt": f"q{i}", "reward_model": {"ground_truth": "152"},
             "extra_info": {"answer": a}} for i, a in enumerate(answers)]
    val_ds = RLHFDataset(rows, TOK, max_prompt_length=32, name="val")
    with RewardManager(cfg.reward, TOK, R) as reward_fn:
        metrics = Validator(cfg, val_ds, ScriptedActor(), reward_fn).run(step=0)
        scored = reward_fn.score(ScriptedActor().generate_sequences(val_ds.collate([val_ds[i] for i in range(4)])))
    assert np.all(scored.raw_scores[1:3] > 0) and metrics["val/accuracy"] == 0.25
    assert metrics["val/hybridflow/arithmetic/accuracy"] == 0.25
