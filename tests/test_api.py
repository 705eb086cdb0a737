"""The Python API (`hybridflow.train`): a config built in code, reward functions of verl's and TRL's signatures
and a dataset object, trained through the same path as `hybridflow train`."""

from __future__ import annotations

import pyarrow as pa
import pytest

import hybridflow
from hybridflow.api import as_verl_reward, to_rows

CALLS: list[dict] = []


def exact(data_source, solution_str, ground_truth, extra_info=None):  # verl's signature
    return float(solution_str.strip() == str(ground_truth))


def has_digit(completions, ground_truth, difficulty, **kwargs):  # TRL's: one score per completion
    CALLS.append({"completions": completions, "ground_truth": ground_truth, "difficulty": difficulty})
    return [0.5 * any(c.isdigit() for c in text) for text in completions]


def _rows(n: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"{i}+{i}="}], "ground_truth": str(2 * i),
             "difficulty": i % 3, "data_source": "sums"} for i in range(n)]


def test_train_with_reward_functions_and_a_list_of_dicts(tmp_path):
    cfg = hybridflow.build_config(
        {"model": {"override_config": {"num_hidden_layers": 1}},
         "trainer": {"device": "cpu", "backend": "local", "logger": [], "run_dir": str(tmp_path / "run"),
                     "default_local_dir": str(tmp_path / "ckpt"), "total_training_steps": 2,
                     "val_before_train": False}},
        "data.train_batch_size=4", "data.max_response_length=4", "rollout.n=2", "actor.ppo_mini_batch_size=4")
    history = hybridflow.train(cfg, reward_fns=[exact, has_digit], train_dataset=_rows(8), eval_dataset=_rows(2))
    assert [int(m["training/global_step"]) for m in history if "reward/score/mean" in m] == [1, 2]
    assert {"reward/exact/mean", "reward/has_digit/mean", "val/sums/reward", "val/sums/accuracy"} <= set(history[-1])
    # the TRL-style function got its dataset's columns, one completion at a time
    assert CALLS and all(len(c["completions"]) == 1 and c["difficulty"][0] in (0, 1, 2) for c in CALLS)
    assert (tmp_path / "run" / "data" / "train.parquet").is_file()  # what `hybridflow train` would have read


def test_dataset_objects_become_verl_rows():
    rows = _rows(2)
    expected = to_rows(rows)
    assert expected[0]["reward_model"] == {"style": "rule", "ground_truth": "0"}
    assert to_rows(pa.Table.from_pylist(rows)) == expected
    datasets = pytest.importorskip("datasets")
    assert to_rows(datasets.Dataset.from_list(rows)) == expected
    with pytest.raises(TypeError, match="train_dataset: expected a datasets.Dataset"):
        to_rows(42)


def test_a_reward_function_of_neither_signature_is_refused():
    with pytest.raises(TypeError, match=r"reward_fns\[0\].*solution_str.*TRL"):
        as_verl_reward(lambda text, answer: 1.0)
    assert as_verl_reward(has_digit)("d", "a1", "2", {"difficulty": 1}) == 0.5


def test_config_layers_and_errors(tmp_path):
    cfg = hybridflow.build_config({"rollout": {"n": 3}}, "rollout.n=5")
    assert cfg.rollout.n == 5
    with pytest.raises(ValueError, match="unknown config key 'rollout.nn'"):
        hybridflow.build_config({"rollout": {"nn": 3}})
    with pytest.raises(ValueError, match="no prompt column 'prompt'"):
        hybridflow.train(hybridflow.build_config(f"trainer.run_dir={tmp_path}"), train_dataset=[{"question": "q"}])
