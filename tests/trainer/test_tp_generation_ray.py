"""Tensor-parallel generation in training (Ray, 2 ranks, gloo): GRPO with rollout.tensor_model_parallel_size=2 samples
the same tokens, scores the same rewards and validation and trains to the same losses as tp=1 — full fine-tuning
and LoRA — and a tp=2 run resumed from its step-1 checkpoint repeats step 2. TP changes only the memory layout."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from ppo_testlib import deterministic_metrics, tiny_ppo_config

from hybridflow.trainer.ppo import PPOTrainer

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]

TP = "rollout.tensor_model_parallel_size"
RESHARD = "rollout/reshard_"


def _run(tmp: Path, name: str, *extra: str) -> tuple[list[dict[str, float]], list[torch.Tensor]]:
    """(metrics per logged step, the responses of each training step)."""
    cfg = tiny_ppo_config(tmp, tmp / name / "ckpt", 2, "trainer.backend=ray", "trainer.n_gpus_per_node=2",
                          "algorithm.adv_estimator=grpo", "trainer.total_training_steps=2",
                          "trainer.val_before_train=true", "trainer.checkpoint.save_freq=1",
                          "trainer.checkpoint.async_save=false", f"trainer.run_dir={tmp / name / 'run'}",
                          "trainer.logger=[jsonl]", *extra)
    trainer = PPOTrainer(cfg)
    responses: list[torch.Tensor] = []
    generate = trainer.algorithm.generate

    def recording(batch, metrics):
        out = generate(batch, metrics)
        responses.append(out.batch["responses"].clone())
        return out

    trainer.algorithm.generate = recording
    try:
        return trainer.fit(), responses
    finally:
        trainer.close()


def _same_run(expected: list[dict[str, float]], got: list[dict[str, float]], rel: float = 1e-5) -> None:
    """Every metric of `expected` (but wall clock and reshard bytes) in `got`, equal within `rel` (0: bit for bit)."""
    assert len(expected) == len(got) > 0
    for a, b in zip(expected, got):
        a = {k: v for k, v in deterministic_metrics(a).items() if not k.startswith(RESHARD)}
        assert set(a) <= set(b), set(a) - set(b)
        for key, value in a.items():
            if isinstance(value, float) and math.isfinite(value):
                assert b[key] == (value if rel == 0 else pytest.approx(value, rel=rel, abs=1e-6)), key


def test_tensor_parallel_generation_changes_nothing_but_the_layout(tmp_path: Path) -> None:
    base, base_rows = _run(tmp_path, "tp1", f"{TP}=1")
    tp, tp_rows = _run(tmp_path, "tp2", f"{TP}=2")
    assert len(tp_rows) == 2 and all(torch.equal(a, b) for a, b in zip(base_rows, tp_rows))
    _same_run(base, tp)
    trained = [m for m in tp if m.get("training/global_step", 0) >= 1]
    assert [m["training/global_step"] for m in trained] == [1, 2]
    assert any(k.startswith("val/") for k in tp[0]) and any(k.startswith("val/") for k in tp[-1])
    assert all(m[f"{RESHARD}bytes_in"] > 0 and m[f"{RESHARD}peak_mb"] > 0 for m in trained)
    assert all(f"{RESHARD}bytes_in" not in m for m in base)

    # resumed from tp=2's step-1 checkpoint: step 2 as in the uninterrupted run
    resumed, resumed_rows = _run(tmp_path, "resume", f"{TP}=2", "trainer.resume_mode=path",
                                 f"trainer.resume_path={tmp_path / 'tp2' / 'ckpt' / 'global_step_1'}",
                                 "trainer.val_before_train=false")
    assert torch.equal(resumed_rows[0], tp_rows[1])
    step2 = next(m for m in tp if m.get("training/global_step") == 2)
    _same_run([step2], [next(m for m in resumed if m.get("training/global_step") == 2)], rel=0)


def test_tensor_parallel_generation_with_lora_merges_on_slices(tmp_path: Path) -> None:
    lora = ("model.lora.rank=4", "model.lora.alpha=8", "actor.optim.lr=3e-2", "trainer.checkpoint.save_freq=0",
            "trainer.val_before_train=false")
    base, base_rows = _run(tmp_path, "lora1", f"{TP}=1", *lora)
    tp, tp_rows = _run(tmp_path, "lora2", f"{TP}=2", *lora)
    assert len(tp_rows) == 2 and all(torch.equal(a, b) for a, b in zip(base_rows, tp_rows))
    _same_run(base, tp)
    assert all(m[f"{RESHARD}bytes_in"] > 0 for m in tp if m.get("training/global_step", 0) >= 1)
