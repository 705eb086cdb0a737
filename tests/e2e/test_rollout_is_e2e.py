"""Off-policy correction end to end: a 2-step GRPO run on CPU (tiny model, built-in task) with each
`algorithm.rollout_is.mode` reports finite `rollout_is/*` metrics and a finite loss; so does an fp8 rollout, which
turns TIS on by itself."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hybridflow.commands.quickstart import QUICKSTART_YAML
from hybridflow.config import load_config
from hybridflow.trainer.ppo import PPOTrainer

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", ["tis", "mask"])
def test_grpo_two_steps_with_rollout_is(mode: str, tmp_path: Path) -> None:
    steps = _two_steps(tmp_path, f"algorithm.rollout_is.mode={mode}")
    assert len(steps) == 2
    expected = {"rollout_is/mean", "rollout_is/max", "rollout_is/clip_frac"} | (
        {"rollout_is/mask_frac"} if mode == "mask" else set())
    for m in steps:
        assert expected <= m.keys(), f"missing {expected - m.keys()}"
        bad = {k: v for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"{mode}: non-finite metrics {bad}"
        assert "timing/old_log_prob" in m  # the correction needs the recomputed old log-probs
        # sync mode on CPU (fp32 both sides, same weights): the ratio is 1 up to rounding (measured max 1.000001)
        assert abs(m["rollout_is/mean"] - 1.0) < 0.01 and m["rollout_is/max"] < 1.1
        assert 0.0 <= m["rollout_is/clip_frac"] <= 1.0
        assert math.isfinite(m["actor/pg_loss"])


def _two_steps(tmp_path: Path, *overrides: str) -> list[dict]:
    cfg = load_config([QUICKSTART_YAML], [
        f"trainer.run_dir={tmp_path}/run", f"trainer.default_local_dir={tmp_path}/ckpt", "trainer.logger=[jsonl]",
        "algorithm.adv_estimator=grpo", "algorithm.rollout_is.cap=2.0",
        "trainer.total_training_steps=2", "trainer.val_before_train=false", "data.val_size=8",
        "data.train_size=64", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4", *overrides])
    trainer = PPOTrainer(cfg)
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    return [m for m in history if m["training/global_step"] >= 1]


def test_grpo_two_steps_with_an_fp8_rollout_reports_the_mismatch(tmp_path: Path) -> None:
    steps = _two_steps(tmp_path, "rollout.quantization=fp8")  # rollout_is.mode left at auto: tis
    assert len(steps) == 2
    for m in steps:
        assert {"rollout_is/mean", "rollout_is/max", "rollout_is/clip_frac"} <= m.keys()
        bad = {k: v for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"fp8: non-finite metrics {bad}"
        # the trainer scores fp32 weights, the rollout sampled from fp8 ones: the ratio is no longer 1 to rounding
        assert m["rollout_is/max"] > 1.001 and 0.9 < m["rollout_is/mean"] < 1.1
