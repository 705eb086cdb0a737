"""End-to-end PPO/GRPO mechanics on CPU with the tiny model and the built-in arithmetic task: per estimator
(finite metrics), the reference KL at step 1 (exactly 0), the Ray backend (2 ranks generate and score exactly
what 1 local rank does) and GRPO with images (tiny-vl on colour_count). Learning is tested by stage in
test_learning_stages.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hybridflow.algorithms import ADVANTAGE_ESTIMATORS
from hybridflow.commands.quickstart import QUICKSTART_YAML
from hybridflow.config import load_config
from hybridflow.trainer.ppo import PPOTrainer

pytestmark = pytest.mark.slow


def _cfg(tmp: Path, *overrides: str):
    # 64 training prompts: these runs take 1-2 steps of at most 32; the quickstart's 64,000 cost seconds to build
    return load_config([QUICKSTART_YAML], [f"trainer.run_dir={tmp}/run", f"trainer.default_local_dir={tmp}/ckpt",
                                           "trainer.logger=[jsonl]", "data.train_size=64", *overrides])


def _fit(cfg) -> list[dict[str, float]]:
    trainer = PPOTrainer(cfg)
    try:
        return trainer.fit()
    finally:
        trainer.close()


def test_first_step_kl_between_actor_and_ref_is_exactly_zero(tmp_path: Path) -> None:
    # Same micro-batching for the actor's and the reference's log-prob passes → the same arithmetic, bit for bit.
    # (The KL in the reward makes the step recompute the old policy's log-probs, which kl/actor_ref is measured on.)
    history = _fit(_cfg(tmp_path, "actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true",
                        "trainer.total_training_steps=1", "trainer.val_before_train=false", "data.val_size=8",
                        "ref.log_prob_micro_batch_size_per_gpu=256"))
    step1 = next(m for m in history if m["training/global_step"] == 1)
    assert step1["kl/actor_ref"] == 0.0
    assert abs(step1["actor/kl_loss"]) < 1e-6  # the training forward (with grad) vs the no-grad reference pass


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS.names()))
def test_every_estimator_runs_two_steps_without_nan(estimator: str, tmp_path: Path) -> None:
    teacher = ["teacher.preset=tiny"] if estimator == "distill" else []  # distillation needs a teacher model
    history = _fit(_cfg(tmp_path, f"algorithm.adv_estimator={estimator}", "trainer.total_training_steps=2",
                        "trainer.val_before_train=false", "data.val_size=8", "data.train_batch_size=8",
                        "actor.ppo_mini_batch_size=8", "rollout.n=4", "critic.ppo_mini_batch_size=8", *teacher))
    steps = [m for m in history if m["training/global_step"] >= 1]
    assert len(steps) == 2
    for m in steps:
        bad = {k: v for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"{estimator}: non-finite metrics {bad}"
        assert "actor/pg_loss" in m


@pytest.mark.ray
def test_ray_backend_two_ranks_matches_local_first_step(tmp_path: Path) -> None:
    common = ("trainer.total_training_steps=2", "trainer.val_before_train=false", "data.val_size=8",
              "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4", "actor.optim.lr=1e-3")
    local = _fit(_cfg(tmp_path / "local", *common))
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        ray = _fit(_cfg(tmp_path / "ray", *common, "trainer.backend=ray", "trainer.n_gpus_per_node=2"))
        assert torch.get_num_threads() == 2  # the driver only runs small host ops (controller/backends/ray.py)
    finally:
        torch.set_num_threads(threads)
    l1, r1 = local[0], ray[0]
    assert len(ray) == 2
    for key in ("reward/score/mean", "response_length/mean", "adv/mean", "adv/max", "prompt_length/mean"):
        assert r1[key] == pytest.approx(l1[key], abs=1e-6), key
    # The gradient is split-invariant (global token normaliser), so its norm and the summed loss agree.
    for key in ("actor/loss", "actor/grad_norm"):
        assert r1[key] == pytest.approx(l1[key], rel=1e-4, abs=1e-6), key
    assert r1["actor/entropy"] == pytest.approx(l1["actor/entropy"], rel=0.05)  # mean of per-rank means


def test_grpo_with_images_runs_two_steps(tmp_path: Path) -> None:
    # tiny-vl on colour_count: the images reach the rollout and the trainer. The trainer's log-probs of the sampled
    # tokens are the sampler's times (1 - the probability of the never-sampled vision tokens): every IS ratio is
    # just under 1 (~1.9 at the worst when the trainer's forward drops the images).
    history = _fit(_cfg(tmp_path, "model.preset=tiny-vl", "data.task=colour_count", "algorithm.adv_estimator=grpo",
                        "trainer.total_training_steps=2", "trainer.val_before_train=false", "data.train_size=16",
                        "data.val_size=4", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2",
                        "data.max_prompt_length=64", "data.max_response_length=4", "algorithm.rollout_is.mode=tis"))
    steps = [m for m in history if m["training/global_step"] >= 1]
    assert len(steps) == 2
    for m in steps:
        bad = {k: v for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"non-finite metrics {bad}"
        assert 0.9 < m["rollout_is/mean"] <= m["rollout_is/max"] <= 1.0 + 1e-4
