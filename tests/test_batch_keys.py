"""The PPO batch contract (`hybridflow/protocol/keys.py`): the checker's errors, debug mode off by default, a
whole PPO step (GAE, KL in reward and as a loss, recomputed old log-probs) that keeps the contract, and no key
spelled as a string literal anywhere else in `hybridflow/`."""

from __future__ import annotations

import ast
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from ppo_testlib import tiny_ppo_config

import hybridflow
from hybridflow.protocol import DataProto, keys


def _after_gen(B: int = 4, P: int = 3, R: int = 5) -> DataProto:
    ids = torch.ones(B, P + R, dtype=torch.long)
    return DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": ids, "position_ids": ids.cumsum(-1), "prompts": ids[:, :P],
                 "responses": ids[:, P:], "response_mask": ids[:, P:], "rollout_log_probs": torch.zeros(B, R),
                 "token_level_scores": torch.zeros(B, R)},
        non_tensors={"uid": np.array([str(i // 2) for i in range(B)], dtype=object)})


def test_a_well_formed_batch_passes_every_stage_input():
    batch = _after_gen()
    for stage in (keys.GEN, keys.REWARD, keys.OLD_LOG_PROB, keys.REF, keys.VALUES_STAGE, keys.ADV):
        keys.check(stage, batch, "in")


def test_a_missing_key_names_the_stage_and_its_writer():
    with pytest.raises(keys.BatchContractError, match=r"'update_critic' \(input\).*'values' \(written by values\)"):
        keys.check(keys.UPDATE_CRITIC, _after_gen(), "in")


def test_wrong_kind_and_inconsistent_shapes_are_caught():
    bad_kind = _after_gen()
    bad_kind.batch["token_level_scores"] = torch.zeros(4, 5, dtype=torch.long)
    with pytest.raises(keys.BatchContractError, match="'token_level_scores' is int"):
        keys.check(keys.ADV, bad_kind, "in")
    bad_width = _after_gen()
    bad_width.batch["token_level_scores"] = torch.zeros(4, 6)
    with pytest.raises(keys.BatchContractError, match="'token_level_scores' has R=6 but other keys have R=5"):
        keys.check(keys.ADV, bad_width, "in")


def test_meta_info_holds_declared_metadata_only():
    batch = _after_gen()
    batch.meta_info.update(temperature=0.7, epoch=1)
    keys.check(keys.REWARD, batch, "in")
    batch.meta_info["token_level_scores"] = [0.0]
    with pytest.raises(keys.BatchContractError, match="meta_info holds undeclared keys"):
        keys.check(keys.REWARD, batch, "in")


def test_every_stage_key_is_declared_once_with_verl_names():
    assert {"old_log_probs", "ref_log_prob", "values", "advantages", "returns", "response_mask",
            "token_level_scores", "token_level_rewards", "entropy"} <= set(keys.KEYS)
    assert "entropys" not in keys.KEYS


class _Stage:
    @keys.checked_stage(keys.UPDATE_CRITIC)
    def update(self, batch: DataProto) -> dict[str, float]:
        return {"ran": 1.0}


def test_checks_are_off_by_default_and_on_with_the_env_var(monkeypatch):
    monkeypatch.delenv(keys.CHECK_ENV, raising=False)
    assert _Stage().update(_after_gen()) == {"ran": 1.0}  # a bad batch goes through untouched
    monkeypatch.setenv(keys.CHECK_ENV, "1")
    with pytest.raises(keys.BatchContractError, match="'values'"):
        _Stage().update(_after_gen())


class _LateStage:
    @keys.checked_stage(keys.UPDATE_CRITIC)
    def update(self, batch: DataProto, late=None) -> dict[str, float]:
        return {"late_values": float(late().batch["values"].sum())}


def test_a_stage_given_late_columns_is_checked_on_the_batch_they_complete(monkeypatch):
    monkeypatch.setenv(keys.CHECK_ENV, "1")
    batch = _after_gen()
    done = _after_gen()
    done.batch.update(values=torch.ones(4, 5), returns=torch.zeros(4, 5))
    assert _LateStage().update(batch, late=lambda: done) == {"late_values": 20.0}
    done.batch["values"] = torch.ones(4, 6)
    with pytest.raises(keys.BatchContractError, match="'values' has R=6"):
        _LateStage().update(batch, late=lambda: done)


class _ValuesStage:
    @keys.checked_stage(keys.VALUES_STAGE)
    def compute(self, batch: DataProto, extra: str | None = None) -> DataProto:
        out = {"values": torch.zeros(len(batch), 5)} | ({extra: torch.zeros(len(batch))} if extra else {})
        return DataProto.from_dict(out)


def test_a_stage_that_adds_a_key_it_does_not_declare_fails(monkeypatch):
    monkeypatch.setenv(keys.CHECK_ENV, "1")
    assert set(_ValuesStage().compute(_after_gen()).batch) == {"values"}
    with pytest.raises(keys.BatchContractError, match=r"'values' wrote \['value_std'\], which it does not declare"):
        _ValuesStage().compute(_after_gen(), "value_std")


def test_sampling_log_probs_prefers_the_recomputed_ones():
    batch = _after_gen().batch
    assert keys.sampling_log_probs(batch) is batch["rollout_log_probs"]
    batch["old_log_probs"] = torch.ones(4, 5)
    assert keys.sampling_log_probs(batch) is batch["old_log_probs"]


def test_a_ppo_step_keeps_the_contract(tmp_path: Path, monkeypatch):
    from hybridflow.trainer.ppo import PPOTrainer

    monkeypatch.setenv(keys.CHECK_ENV, "1")
    cfg = tiny_ppo_config(tmp_path, tmp_path / "ckpt", 1, "algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true",
                          "actor.use_kl_loss=true", "trainer.total_training_steps=1",
                          "trainer.checkpoint.save_freq=0")
    trainer = PPOTrainer(cfg)
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    assert len(history) == 1 and np.isfinite(history[0]["critic/vf_loss"])


def test_a_key_is_its_name_and_pickles_as_the_declaration():
    batch = {"responses": torch.ones(2, 3)}
    assert batch[keys.RESPONSES] is batch["responses"] and f"{keys.RESPONSES}" == "responses"
    assert pickle.loads(pickle.dumps(keys.RESPONSES)) is keys.RESPONSES
    assert keys.RESPONSES.dims == ("B", "R") and type(keys.RESPONSES.name) is str


# A string equal to a key name, outside keys.py, that is another thing of the same name — file: (words, why).
NOT_BATCH_KEYS: dict[str, tuple[tuple[str, ...], str]] = {
    "api.py": (("data_source", "reward_model", "extra_info"), "dataset columns; api.py stays free of torch, "
               "which hybridflow.protocol imports"),
    "preflight.py": (("data_source", "extra_info"), "a dataset column and verl's reward-function parameters; "
                     "torch-free like api.py"),
    "rewards/custom.py": (("data_source", "extra_info"), "parameters of verl's reward-function signature"),
    "commands/config.py": (("reward_model",), "a config section"),
    "config/verl_keys.py": (("reward_model",), "a config section of verl"),
    "trainer/roles.py": (("reward_model",), "a worker role"),
    "config/plan.py": (("prompts",), "the unit a PPO batch size counts"),
    "trainer/async_resume.py": (("prompts",), "a field of the saved state"),
    "planning/from_config.py": (("values",), "a stage name"),
    "planning/memory.py": (("values",), "a stage name"),
    "planning/step_time.py": (("values",), "a stage name"),
    "tracking/plots.py": (("values", "entropy"), "a stage name and a plot colour"),
    "protocol/serialization.py": (("values",), "a field of a saved array's JSON"),
    "data/templates.py": (("input_ids",), "the output field of a Hugging Face tokenizer"),
    "engine/attention.py": (("attention_mask",), "a keyword of Hugging Face's mask function"),
    "trainer/judge.py": (("input_ids",), "the output field of a Hugging Face tokenizer"),
    "algorithms/advantages.py": (("teacher_log_probs",), "an argument's name in an error message (algorithms/ sits "
                                 "below protocol/)"),
}


def _key_literals(root: Path) -> tuple[list[str], set[tuple[str, str]]]:
    """`file:line: literal` for each string constant (docstrings aside) equal to a key name, and the
    NOT_BATCH_KEYS entries that matched one."""
    const = {key.name: name for name, key in vars(keys).items() if isinstance(key, keys.Key)}
    quoted = re.compile("[\"']({})[\"']".format("|".join(const)))  # files without one need no parse
    found, allowed = [], set()
    for path in sorted(root.rglob("*.py")):
        rel, text = path.relative_to(root).as_posix(), path.read_text(encoding="utf-8")
        if rel == "protocol/keys.py" or not quoted.search(text):
            continue
        tree = ast.parse(text)
        docstrings = {id(node.body[0].value) for node in ast.walk(tree) if isinstance(
            node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body and isinstance(
            node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in const
                    and id(node) not in docstrings):
                continue
            if node.value in NOT_BATCH_KEYS.get(rel, ((), ""))[0]:
                allowed.add((rel, node.value))
            else:
                found.append((rel, node.lineno, f"{node.value!r} (write keys.{const[node.value]})"))
    return [f"hybridflow/{rel}:{line}: {what}" for rel, line, what in sorted(found)], allowed


def test_batch_keys_are_written_through_keys_py():
    found, allowed = _key_literals(Path(hybridflow.__file__).parent)
    assert not found, "batch keys spelled as strings; use the constants of hybridflow/protocol/keys.py (or, " \
        "for another thing of the same name, add it to NOT_BATCH_KEYS with why):\n" + "\n".join(found)
    stale = {(f, w) for f, (words, _) in NOT_BATCH_KEYS.items() for w in words} - allowed
    assert not stale, f"NOT_BATCH_KEYS entries that match nothing any more; delete them: {sorted(stale)}"
