"""Rollback decisions on the health monitor's val_drop, NaN guard counting, epoch-boundary data positions."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from hybridflow.checkpoint import (
    RollbackTracker,
)
from hybridflow.checkpoint.recovery import scale_lr
from hybridflow.data.dataloader import DataPosition
from hybridflow.tracking import HealthMonitor
from hybridflow.tracking.health import NonFiniteError, NonFiniteGuard


def test_rollback_on_the_monitors_val_drop_targets_best_checkpoint() -> None:
    """The health monitor counts the falls; the tracker scores checkpoints and decides on the monitor's warning."""
    mon = HealthMonitor(SimpleNamespace(gen_time_warn_s=1.0, update_jitter_warn_s=0.1, jitter_window=5,
                                        val_drop_patience=3, memory_warn_frac=0.95))
    tr = RollbackTracker(lr_scale=0.5, max_rollbacks=2)
    # validation every step, checkpoint every step; metric rises to a peak at step 3 then falls
    values = [0.1, 0.3, 0.5, 0.45, 0.44, 0.40, 0.39]
    decisions = []
    for step, v in enumerate(values, start=1):
        tr.observe({"val/reward": v})
        drops = [e for e in mon.check({"val/reward": v}, step) if e.kind == "val_drop"]
        d = tr.decide(drops[0].message) if drops else None
        decisions.append(d)
        if d is not None:
            mon.reset_val()
            break  # the trainer reloads d.target_step instead of saving this step
        tr.on_checkpoint(step)
    assert decisions[:5] == [None] * 5  # two falls are within patience
    d = decisions[5]
    assert d is not None and d.target_step == 3 and d.lr_scale == 0.5 and d.rollback_index == 1
    assert "worse 3" in d.reason
    assert sorted(tr.ckpt_scores) == [1, 2, 3]  # the abandoned branch (4, 5) is forgotten
    assert mon.check({"val/reward": 0.3}, 7) == []  # a fresh falling streak is needed for the next rollback
    tr.observe({"val/reward": 0.3})
    tr.on_checkpoint(4)
    assert tr.best_step == 3


def test_a_loss_metric_rolls_back_when_it_rises_not_when_it_improves() -> None:
    from hybridflow.config.schema import RollbackConfig

    cfg = RollbackConfig(enable=True, metric="val/loss", lr_scale=1.0, max_rollbacks=2)  # mode auto → lower is better
    assert not cfg.higher_is_better() and RollbackConfig(True, "val/reward", 1.0, 2).higher_is_better()
    assert RollbackConfig(True, "val/loss", 1.0, 2, mode="max").higher_is_better()
    assert not RollbackConfig(True, "val/nll", 1.0, 2).higher_is_better()  # whole words of the name, not substrings
    assert RollbackConfig(True, "val/applicability", 1.0, 2).higher_is_better()
    mon = HealthMonitor(SimpleNamespace(gen_time_warn_s=1.0, update_jitter_warn_s=0.1, jitter_window=5,
                                        val_drop_patience=2, memory_warn_frac=0.95), rollback_metric="val/loss",
                        higher_is_better=cfg.higher_is_better())
    tr = RollbackTracker(metric="val/loss", higher_is_better=cfg.higher_is_better())
    falling = [2.0, 1.5, 1.0, 0.8]  # a loss improving every validation: never a rollback
    assert all(not [e for e in mon.check({"val/loss": v}, s) if e.kind == "val_drop"] for s, v in enumerate(falling))
    for step, v in enumerate(falling, start=1):
        tr.observe({"val/loss": v})
        tr.on_checkpoint(step)
    assert tr.best_step == 4  # the lowest loss
    events = [e for s, v in enumerate([0.9, 1.1], start=5) for e in mon.check({"val/loss": v}, s)]
    assert [e.kind for e in events] == ["val_drop"] and "worse 2" in events[0].message


def test_rollback_bounded_by_max_rollbacks_and_state_roundtrip() -> None:
    tr = RollbackTracker(max_rollbacks=1)
    tr.observe({"val/reward": 1.0})
    tr.on_checkpoint(1)
    assert tr.decide("fell").target_step == 1
    tr2 = RollbackTracker(max_rollbacks=1)
    tr2.load_state_dict(tr.state_dict())
    assert tr2.decide("fell again") is None  # max reached, even after a resume
    assert tr2.rollbacks == 1 and tr2.ckpt_scores == {1: 1.0}
    assert RollbackTracker().decide("no checkpoint yet") is None


def test_nan_validation_counts_as_a_fall_and_the_streak_survives_a_resume() -> None:
    cfg = SimpleNamespace(gen_time_warn_s=1.0, update_jitter_warn_s=0.1, jitter_window=5, val_drop_patience=2,
                          memory_warn_frac=0.95)
    mon = HealthMonitor(cfg)
    assert mon.check({"val/reward": 1.0}, 1) == [] and mon.check({"val/reward": 0.5}, 2) == []
    resumed = HealthMonitor(cfg)
    resumed.load_val_state(json.loads(json.dumps(mon.val_state())))
    assert [e.kind for e in resumed.check({"val/reward": math.nan}, 3)] == ["val_drop"]


def test_nan_guard_skips_counts_and_raises() -> None:
    g = NonFiniteGuard(max_consecutive_bad_steps=3)
    assert g.check(torch.tensor(1.0), 2.0)
    assert not g.check(torch.tensor(float("nan")), 1.0, step=2)
    assert not g.check(1.0, float("inf"), step=3)
    assert g.check(1.0, 1.0)  # a good step resets the run
    assert g.metrics() == {"train/skipped_steps": 2.0, "train/consecutive_bad_steps": 0.0}
    assert not g.check(float("nan"), step=5)
    assert not g.check(torch.tensor([1.0, float("-inf")]), step=6)
    with pytest.raises(NonFiniteError, match="trainer.max_consecutive_bad_steps"):
        g.check(float("nan"), step=7)
    assert g.skipped_total == 5


def test_nan_guard_requests_rollback_when_enabled() -> None:
    g = NonFiniteGuard(max_consecutive_bad_steps=2, rollback_enabled=True)
    g.check(float("nan"))
    assert not g.rollback_requested
    g.check(float("nan"))
    assert g.rollback_requested and g.consecutive == 0
    g2 = NonFiniteGuard(2)
    g2.load_state_dict(g.state_dict())
    assert g2.skipped_total == 2


def test_data_position_at_epoch_boundary_trains_remaining_epochs() -> None:
    spe = 4
    saved = DataPosition(epoch=1, batch=4)  # sampler state taken right after the last batch of epoch 1
    assert DataPosition.from_dict(saved.to_dict(), spe) == DataPosition(2, 0)
    # naive reference: enumerate (epoch, batch) pairs of a full run and skip the first `step` of them
    for step in range(0, 12):
        pos = DataPosition(0, step).normalized(spe)
        assert (pos.epoch, pos.batch) == [(e, b) for e in range(3) for b in range(spe)][step]
    with pytest.raises(ValueError, match="steps_per_epoch=0"):
        saved.normalized(0)


def test_scale_lr_survives_lambda_scheduler_steps() -> None:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    sched.step()
    scale_lr(opt, sched, 0.5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.25)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 / 3)  # the schedule keeps the scale
