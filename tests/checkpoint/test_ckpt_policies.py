"""Rollback decisions on a synthetic metric, NaN guard counting, epoch-boundary data positions."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.checkpoint import (
    DataPosition,
    NonFiniteError,
    NonFiniteGuard,
    RollbackTracker,
    position_from_step,
    remaining_batches,
    scale_lr,
)


def test_rollback_triggers_after_patience_falls_and_targets_best() -> None:
    tr = RollbackTracker(patience=3, lr_scale=0.5, max_rollbacks=2)
    # validation every step, checkpoint every step; metric rises to a peak at step 3 then falls
    values = [0.1, 0.3, 0.5, 0.45, 0.44, 0.40, 0.39]
    decisions = []
    for step, v in enumerate(values, start=1):
        d = tr.observe({"val/reward": v})
        decisions.append(d)
        if d is not None:
            break  # the trainer reloads d.target_step instead of saving this step
        tr.on_checkpoint(step)
    assert decisions[:5] == [None] * 5  # two falls are within patience
    d = decisions[5]
    assert d is not None and d.target_step == 3 and d.lr_scale == 0.5 and d.rollback_index == 1
    assert "fell 3" in d.reason
    assert sorted(tr.ckpt_scores) == [1, 2, 3]  # the abandoned branch (4, 5) is forgotten
    # training resumes from step 3; a fresh falling streak is needed for the next rollback
    assert tr.observe({"val/reward": 0.49}) is None
    tr.on_checkpoint(4)
    assert tr.best_step == 3


def test_rollback_flat_or_rising_metric_never_triggers() -> None:
    tr = RollbackTracker(patience=2)
    for step, v in enumerate([0.5, 0.5, 0.6, 0.5, 0.55, 0.5, 0.7], start=1):
        assert tr.observe({"val/reward": v}) is None
        tr.on_checkpoint(step)


def test_rollback_bounded_by_max_rollbacks_and_state_roundtrip() -> None:
    tr = RollbackTracker(patience=1, max_rollbacks=1)
    tr.observe({"val/reward": 1.0})
    tr.on_checkpoint(1)
    assert tr.observe({"val/reward": 0.5}).target_step == 1
    tr2 = RollbackTracker(patience=1, max_rollbacks=1)
    tr2.load_state_dict(tr.state_dict())
    assert tr2.observe({"val/reward": 0.2}) is None  # max reached, even after a resume
    assert tr2.rollbacks == 1 and tr2.ckpt_scores == {1: 1.0}


def test_rollback_lower_is_better_and_nan_counts_as_fall() -> None:
    tr = RollbackTracker(patience=2, metric="val/loss", higher_is_better=False)
    tr.observe({"val/loss": 1.0})
    tr.on_checkpoint(10)
    assert tr.observe({"val/loss": 1.2}) is None
    assert tr.observe({"val/loss": math.nan}).target_step == 10
    assert tr.observe({"other": 1.0}) is None


def test_rollback_forget_after_drops_abandoned_branch() -> None:
    tr = RollbackTracker(patience=5)
    for step, v in [(1, 0.2), (2, 0.9), (3, 0.1)]:
        tr.observe({"val/reward": v})
        tr.on_checkpoint(step)
    tr.forget_after(1)
    assert tr.best_step == 1


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
    assert position_from_step(8, spe) == DataPosition(2, 0)  # after 2 full epochs → start of epoch 2
    assert position_from_step(9, spe) == DataPosition(2, 1)
    saved = DataPosition(epoch=1, batch=4)  # sampler state taken right after the last batch of epoch 1
    assert DataPosition.from_dict(saved.to_dict(), spe) == DataPosition(2, 0)
    assert remaining_batches(saved, spe, total_epochs=3) == 4
    assert remaining_batches(DataPosition(2, 0), spe, total_epochs=2) == 0
    # naive reference: enumerate (epoch, batch) pairs of a full run and skip the first `step` of them
    for step in range(0, 13):
        order = [(e, b) for e in range(3) for b in range(spe)][step:]
        pos = position_from_step(step, spe)
        assert remaining_batches(pos, spe, 3) == len(order)
        if order:
            assert (pos.epoch, pos.batch) == order[0]


def test_scale_lr_survives_lambda_scheduler_steps() -> None:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    sched.step()
    scale_lr(opt, sched, 0.5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.25)
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 / 3)  # the schedule keeps the scale
