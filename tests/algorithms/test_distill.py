"""On-policy distillation (`algorithm.adv_estimator=distill`): the advantage against a naive reference, the teacher
stage on a tiny PPO step (its key, its dims, a teacher of another size), and the config errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from ppo_testlib import tiny_ppo_config

from hybridflow.algorithms import compute_advantage
from hybridflow.config import load_config
from hybridflow.config.dotted import ConfigError
from hybridflow.config.validate import validate_config
from hybridflow.protocol import keys


def _inputs(B: int = 4, R: int = 5) -> dict:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(B, R)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    scores = torch.zeros(B, R)  # each response's score on its last token
    scores[torch.arange(B), mask.sum(-1).long() - 1] = torch.tensor([1.0, 0.0, 1.0, 1.0])
    return dict(token_level_rewards=scores, response_mask=mask, teacher_log_probs=-torch.rand(B, R, generator=g),
                log_probs=-torch.rand(B, R, generator=g), index=np.array(["a", "a", "b", "b"], dtype=object))


def test_distill_advantage_is_teacher_minus_student_on_response_tokens():
    x = _inputs()
    adv, ret = compute_advantage("distill", **x)
    mask = x["response_mask"]
    for i in range(4):
        for t in range(5):
            want = float(x["teacher_log_probs"][i, t] - x["log_probs"][i, t]) if mask[i, t] else 0.0
            assert adv[i, t].item() == pytest.approx(want, abs=1e-6), (i, t)
    assert torch.equal(adv, ret)
    assert (adv[mask == 0] == 0).all()


def test_distill_mixes_the_task_rewards_grpo_advantage_by_its_weight():
    x = _inputs()
    pure, _ = compute_advantage("distill", **x)
    mixed, _ = compute_advantage("distill", **x, task_reward_weight=0.5)
    # group a: scores 1, 0 -> (score - mean) / (Bessel std + eps) = +-0.7071; group b: equal scores -> 0
    task = torch.tensor([0.5 / (0.5**0.5 + 1e-6), -0.5 / (0.5**0.5 + 1e-6), 0.0, 0.0])[:, None] * x["response_mask"]
    torch.testing.assert_close(mixed, pure + 0.5 * task)


def test_distill_without_teacher_log_probs_names_the_key():
    x = _inputs()
    x["teacher_log_probs"] = None
    with pytest.raises(ValueError, match="teacher_log_probs.*teacher.model_path"):
        compute_advantage("distill", **x)


def _config(tmp_path: Path, *extra: str):
    return tiny_ppo_config(tmp_path, tmp_path / "ckpt", 2, "trainer.total_training_steps=1", *extra)


def test_config_errors_name_the_keys(tmp_path: Path):
    with pytest.raises(ConfigError, match="adv_estimator=distill needs a teacher: set teacher.model_path"):
        validate_config(_config(tmp_path, "algorithm.adv_estimator=distill"))
    with pytest.raises(ConfigError, match="teacher.preset='tiny' with algorithm.adv_estimator=grpo"):
        validate_config(_config(tmp_path, "teacher.preset=tiny"))
    with pytest.raises(ConfigError, match="teacher.model_path='/x' and teacher.preset='tiny'"):
        validate_config(_config(tmp_path, "algorithm.adv_estimator=distill", "teacher.model_path=/x",
                                "teacher.preset=tiny"))
    with pytest.raises(ValueError, match="teacher.task_reward_weight=-1.0"):
        load_config(overrides=["teacher.task_reward_weight=-1.0"])


def _save_tiny(out: Path, **shape: int) -> Path:
    from hybridflow.models.loader import load_module, model_config
    from hybridflow.models.tokenizer import save_builtin_tokenizer

    cfg = load_config(overrides=[f"model.override_config={shape}"]).model
    model = load_module(cfg)
    model.save_pretrained(out)
    save_builtin_tokenizer(out)
    assert model_config(cfg).num_hidden_layers == shape["num_hidden_layers"]
    return out


def _first_batch_through_adv(cfg):
    """A PPO step's stages up to the advantages, on the first batch; the batch after them."""
    from hybridflow.trainer.ppo import PPOAlgorithm
    from hybridflow.trainer.stage_schedule import run_stages
    from hybridflow.trainer.timing import StageTimer

    alg = PPOAlgorithm(cfg)
    try:
        stages = alg.stages(1, timer := StageTimer())
        names = [s.name for s in stages]
        metrics: dict[str, float] = {}
        batch = run_stages(stages[:names.index("adv") + 1], next(iter(alg.loader)), timer, metrics, alg.in_process)
        return names, batch, metrics
    finally:
        alg.groups.close()


def test_teacher_stage_writes_its_key_and_a_copy_of_the_student_scores_zero(tmp_path: Path, monkeypatch):
    monkeypatch.setenv(keys.CHECK_ENV, "1")  # every stage checks the keys it reads and writes, with their dims
    names, batch, metrics = _first_batch_through_adv(_config(tmp_path, "algorithm.adv_estimator=distill",
                                                             "teacher.preset=tiny", "teacher.model_path=null",
                                                             "model.override_config={}"))
    assert names.index("teacher") < names.index("adv") and "ref" not in names
    teacher, mask = batch.batch[keys.TEACHER_LOG_PROBS.name], batch.batch["response_mask"]
    assert teacher.shape == batch.batch["responses"].shape and teacher.dtype == torch.float32
    assert (teacher[mask.bool()] < 0).all()
    # the teacher is the student's preset with the student's seed: the same model, so no gap to distil
    assert abs(metrics["distill/reverse_kl"]) < 1e-4, metrics["distill/reverse_kl"]
    assert batch.batch["advantages"].abs().max() < 1e-3


def test_a_teacher_of_another_size_from_a_directory(tmp_path: Path, monkeypatch):
    monkeypatch.setenv(keys.CHECK_ENV, "1")
    path = _save_tiny(tmp_path / "teacher", num_hidden_layers=2, hidden_size=96, intermediate_size=192)
    _, batch, metrics = _first_batch_through_adv(_config(tmp_path, "algorithm.adv_estimator=distill",
                                                         f"teacher.model_path={path}"))
    mask = batch.batch["response_mask"]
    want = (batch.batch[keys.TEACHER_LOG_PROBS.name] - batch.batch["rollout_log_probs"]) * mask
    torch.testing.assert_close(batch.batch["advantages"], want)
    assert metrics["distill/reverse_kl"] > 0.01  # two random models disagree


@pytest.mark.parametrize("extra", [("model.lora.rank=4",), ("trainer.mode=one_step_off",)], ids=["lora", "one_step_off"])
def test_distillation_runs_with_lora_and_the_async_modes(tmp_path: Path, extra: tuple[str, ...]):
    from hybridflow.trainer.ppo import PPOTrainer

    trainer = PPOTrainer(_config(tmp_path, "algorithm.adv_estimator=distill", "teacher.preset=tiny",
                                 "trainer.checkpoint.save_freq=0", *extra))
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    assert len(history) == 1 and np.isfinite(history[0]["distill/reverse_kl"]), history
    assert history[0]["timing/teacher"] > 0
