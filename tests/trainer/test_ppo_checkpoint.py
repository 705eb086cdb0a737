"""PPOTrainer checkpoint wiring on CPU (tiny model, local backend): resume at an epoch boundary trains the remaining
epoch, auto-rollback on a falling validation metric reloads the best checkpoint and scales the LR, non-finite
steps are skipped and counted and stop the run after `trainer.max_consecutive_bad_steps`, and roles in their own
groups checkpoint under their own roots and resume from the newest step they all have."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from ppo_testlib import SimulatedCrash, tiny_ppo_config

from hybridflow.checkpoint import CheckpointManager
from hybridflow.checkpoint.storage import read_flat_tensors
from hybridflow.tracking import HealthMonitor
from hybridflow.tracking.health import NonFiniteError
from hybridflow.trainer.ppo import PPOTrainer


class RecordingTracker:
    """The slice of `hybridflow.tracking.Tracker` the trainer uses, keeping the events."""

    def __init__(self, health: HealthMonitor | None = None) -> None:
        self.events: list[dict[str, Any]] = []
        self.health = health

    def log(self, metrics: dict[str, float], step: int) -> list[Any]:
        return self.health.check(metrics, step) if self.health is not None else []

    def event(self, kind: str, message: str, step: int, level: str = "info", **data: Any) -> None:
        self.events.append({"kind": kind, "message": message, "step": step, **data})

    def start_progress(self, total_steps: int, initial_step: int = 0) -> None: ...

    def advance(self, step: int) -> None: ...

    def stop_progress(self) -> None: ...


class ScriptedValidator:
    """Stands in for `Validator`: reports a given `val/reward` per step (the synthetic falling metric)."""

    def __init__(self, values: dict[int, float]) -> None:
        self.values = values

    def run(self, step: int) -> dict[str, float]:
        return {"val/reward": self.values[step]}


def _cfg(tmp_path: Path, *extra: str):
    return tiny_ppo_config(tmp_path, tmp_path / "ckpt", 2, "trainer.checkpoint.async_save=false", *extra)


def _fit(trainer: PPOTrainer, crash_at: int | None = None, uids: list | None = None) -> list[dict[str, float]]:
    step = trainer.step

    def wrapped(batch):
        if uids is not None:
            uids.append(list(batch.non_tensor_batch["uid"]))
        if trainer.global_step == crash_at:
            raise SimulatedCrash(f"simulated crash at step {crash_at}")
        return step(batch)

    trainer.step = wrapped
    try:
        trainer.fit()
    except SimulatedCrash:
        pass
    finally:
        trainer.close()
    return trainer.history


def _model(ckpt: Path, component: str = "actor") -> dict[str, torch.Tensor]:
    meta = json.loads((ckpt / "checkpoint.json").read_text())
    return read_flat_tensors(ckpt / component, meta["components"][component]["format"], "model/")


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _steps(history: list[dict[str, float]]) -> list[int]:
    return [int(m["training/global_step"]) for m in history]


def test_resume_at_epoch_boundary_trains_the_remaining_epoch(tmp_path: Path) -> None:
    # 4 prompts / 2 per step = 2 steps per epoch, 2 epochs; the save after step 2 is exactly at the boundary.
    # The reference is an EMA here, so it is part of the checkpoint.
    args = ("data.train_size=4", "trainer.total_epochs=2", "trainer.total_training_steps=null",
            "trainer.checkpoint.save_freq=2", "actor.use_kl_loss=true", "ref.ema.enable=true", "ref.ema.update_every=1000")
    seen_crashed: list = []
    crashed = _fit(PPOTrainer(_cfg(tmp_path, *args)), crash_at=3, uids=seen_crashed)
    assert _steps(crashed) == [1, 2]
    extra = json.loads((tmp_path / "ckpt" / "global_step_2" / "extra.json").read_text())
    assert extra["data"] == {"epoch": 0, "batch": 2}  # saved as "end of epoch 0", normalised when loaded
    meta = json.loads((tmp_path / "ckpt" / "global_step_2" / "checkpoint.json").read_text())
    assert sorted(meta["components"]) == ["actor", "ref"]
    assert not _same(_model(tmp_path / "ckpt" / "global_step_2", "ref"), _model(tmp_path / "ckpt" / "global_step_2"))

    seen_resumed: list = []
    resumed = _fit(PPOTrainer(_cfg(tmp_path, *args)), uids=seen_resumed)
    assert _steps(resumed) == [3, 4]  # not zero steps
    assert [m["training/epoch"] for m in resumed] == [1.0, 1.0]
    assert seen_resumed[0] == seen_crashed[2]  # the batch the crashed run was about to train: epoch 1, batch 0
    assert all("-e1-" in uid for batch in seen_resumed for uid in batch)


def test_rollback_on_falling_val_metric_reloads_best_and_scales_lr(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "trainer.total_training_steps=4", "trainer.test_freq=1", "trainer.checkpoint.save_freq=1",
               "trainer.rollback.enable=true", "trainer.health.val_drop_patience=2", "trainer.rollback.lr_scale=0.5")
    tracker = RecordingTracker(HealthMonitor(cfg.trainer.health))
    trainer = PPOTrainer(cfg, tracker=tracker)
    trainer.validator = ScriptedValidator({1: 0.5, 2: 0.9, 3: 0.7, 4: 0.4})  # best at 2, then falls twice
    history = _fit(trainer)

    assert _steps(history) == [1, 2, 3, 4]
    assert trainer.ckpt.rollbacks == [{"step": 4, "target_step": 2, "lr_scale": 0.5,
                                       "reason": "val/reward got worse 2 validations in a row (now 0.4)"}]
    assert [e["target_step"] for e in tracker.events if e["kind"] == "rollback"] == [2]
    root = tmp_path / "ckpt"
    assert not (root / "global_step_3").exists()  # the abandoned branch is discarded
    # Saved right after the rollback: the weights are step 2's, the LR is halved.
    assert _same(_model(root / "global_step_4"), _model(root / "global_step_2"))
    assert not _same(_model(root / "global_step_2"), _model(root / "global_step_1"))
    mgr = CheckpointManager(root, capture_rng=False)
    lr = {s: mgr.load(root / f"global_step_{s}", restore_rng=False).components["actor"]["optimizer"]
          ["param_groups"][0]["lr"] for s in (2, 4)}
    assert lr[4] == pytest.approx(0.5 * lr[2])
    mgr.close()


def test_non_finite_steps_are_skipped_counted_then_stop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hybridflow.workers.actor_rollout_ref as actor_module

    poison = {"on": False}
    make_loss = actor_module.make_actor_loss

    def poisoned_make_actor_loss(*args: Any, **kwargs: Any):
        loss_fn = make_loss(*args, **kwargs)

        def loss(outputs, batch, norms):
            value, metrics = loss_fn(outputs, batch, norms)
            return (value * float("nan") if poison["on"] else value), metrics

        return loss

    monkeypatch.setattr(actor_module, "make_actor_loss", poisoned_make_actor_loss)
    cfg = _cfg(tmp_path, "trainer.total_training_steps=6", "trainer.checkpoint.save_freq=1",
               "trainer.max_consecutive_bad_steps=2")
    trainer = PPOTrainer(cfg)
    step = trainer.step

    def step_with_nan_at(batch):
        poison["on"] = trainer.global_step in (2, 4, 5)  # one bad step, then two in a row
        return step(batch)

    trainer.step = step_with_nan_at
    with pytest.raises(NonFiniteError, match="max_consecutive_bad_steps"):
        try:
            trainer.fit()
        finally:
            trainer.close()
    history = trainer.history
    assert _steps(history) == [1, 2, 3, 4]  # step 5 is the second bad step in a row: stop before logging it
    assert [m["train/skipped_steps"] for m in history] == [0, 1, 1, 2]
    assert [m["actor/skipped"] > 0 for m in history] == [False, True, False, True]
    root = tmp_path / "ckpt"
    assert _same(_model(root / "global_step_2"), _model(root / "global_step_1"))  # the bad update was skipped
    assert not _same(_model(root / "global_step_3"), _model(root / "global_step_2"))
    assert json.loads((root / "global_step_4" / "extra.json").read_text())["guard"] == \
        {"consecutive": 1, "skipped_total": 2}


def test_separate_role_groups_use_own_roots_and_resume_common_step(tmp_path: Path) -> None:
    args = ("algorithm.adv_estimator=gae", "trainer.use_colocated_worker=false", "resource_pool.max_colocate_count=2",
            "trainer.total_training_steps=3", "trainer.checkpoint.save_freq=1")
    assert _steps(_fit(PPOTrainer(_cfg(tmp_path, *args)), crash_at=3)) == [1, 2]
    root = tmp_path / "ckpt"
    assert sorted(p.name for p in root.iterdir()) == ["actor", "critic"]
    for role in ("actor", "critic"):
        meta = json.loads((root / role / "global_step_2" / "checkpoint.json").read_text())
        assert list(meta["components"]) == [role]
    shutil.rmtree(root / "critic" / "global_step_2")  # the critic's last save never finished

    resumed = _fit(PPOTrainer(_cfg(tmp_path, *args)))
    assert _steps(resumed) == [2, 3]  # both roles went back to step 1, the newest step they both have
