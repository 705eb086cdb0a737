"""`actor_rollout.exact_logprobs` in sync mode: with several mini-batches the PPO step takes the rollout's log-probs
as the old policy's instead of recomputing them — the recompute stage does not run, and the run is the same, bit
for bit, as one that recomputes them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from ppo_testlib import deterministic_metrics, tiny_ppo_config

from hybridflow.config import load_config, resolve
from hybridflow.config.dotted import ConfigError
from hybridflow.config.validate import validate_config
from hybridflow.trainer.ppo import PPOTrainer

STEPS = 1


def _cfg(tmp: Path, *extra: str):
    tmp.mkdir(parents=True, exist_ok=True)
    # mini-batch 1 of 2 prompts: two optimizer steps per PPO step, so old log-probs are needed
    return tiny_ppo_config(tmp, tmp / "ckpt", 1, "actor_rollout.exact_logprobs=true",
                           f"trainer.total_training_steps={STEPS}", "trainer.resume_mode=disable", "trainer.logger=[]",
                           f"trainer.run_dir={tmp}/run", "algorithm.rollout_is.mode=tis", *extra)


def _fit(cfg, recompute: bool) -> tuple[list[dict[str, float]], list[torch.Tensor]]:
    trainer = PPOTrainer(cfg)
    alg = trainer.algorithm
    if recompute:  # the run the switch replaces: the actor recomputes old log-probs
        alg.res = dataclasses.replace(alg.res, recompute_old_log_prob=True, old_log_prob_from_rollout=False)
    olds: list[torch.Tensor] = []
    update = alg.update_actor

    def recording(batch, metrics, beside=None):
        olds.append(batch.batch["old_log_probs"].clone())
        return update(batch, metrics, beside)

    alg.update_actor = recording
    try:
        return [m for m in trainer.fit() if m.get("training/global_step", 0) >= 1], olds
    finally:
        trainer.close()


def test_old_log_probs_come_from_the_rollout_and_change_nothing(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path / "copy")
    res = resolve(cfg)
    assert res.old_log_prob_from_rollout and not res.recompute_old_log_prob
    assert resolve(_cfg(tmp_path / "async", "trainer.mode=one_step_off")).recompute_old_log_prob  # stale: recompute
    copied, olds_copied = _fit(cfg, recompute=False)
    recomputed, olds_recomputed = _fit(_cfg(tmp_path / "recompute"), recompute=True)
    assert len(copied) == len(recomputed) == STEPS
    assert all("timing/old_log_prob" not in m for m in copied)
    assert all("timing/old_log_prob" in m for m in recomputed)
    for a, b in zip(olds_copied, olds_recomputed):
        assert torch.equal(a, b)
    for a, b in zip(copied, recomputed):
        assert a["rollout_is/max"] == 1.0 and b["rollout_is/max"] == 1.0
        assert deterministic_metrics(a) == deterministic_metrics(b)


def test_config_refuses_what_exact_mode_cannot_reproduce() -> None:
    validate_config(load_config(overrides=["actor_rollout.exact_logprobs=true"]))
    for bad in ("data.use_packed_dataset=false", "rollout.name=hf", "rollout.quantization=fp8", "model.lora.rank=8"):
        with pytest.raises(ConfigError, match=rf"actor_rollout.exact_logprobs=true with {bad}"):
            validate_config(load_config(overrides=["actor_rollout.exact_logprobs=true", bad]))
