"""The one loop (`Trainer`) with a fake algorithm and no workers: validation every `test_freq` and at the end, the
algorithm's stop criterion ends the run early, a missed target is reported once at the end, and the NaN guard
counts any algorithm's skipped steps (not only PPO's)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from hybridflow.config import load_config
from hybridflow.protocol import DataProto
from hybridflow.tracking.health import NonFiniteError
from hybridflow.trainer.loop import Algorithm, Trainer


class ListLoader:
    """Two batches per epoch (the slice of `StatefulDataLoader` the loop uses)."""

    epoch, batch_in_epoch = 0, 0
    num_rows, batch_size = 4, 2

    def __iter__(self) -> Iterator[DataProto]:
        return iter([DataProto.from_dict({}), DataProto.from_dict({})])

    def __len__(self) -> int:
        return 2


class FakeAlgorithm(Algorithm):
    guarded = ("fake",)

    def __init__(self, losses: dict[int, float], val_loss: dict[int, float], target: float | None = None) -> None:
        self.loader = ListLoader()  # type: ignore[assignment]
        self.total_steps = 6
        self.losses, self.val_loss, self.target = losses, val_loss, target
        self.validator = self
        self.missed: list[int] = []

    def step(self, batch: DataProto, step: int) -> dict[str, float]:
        return {"fake/loss": self.losses.get(step, 1.0)}

    def run(self, step: int) -> dict[str, float]:
        return {"val/loss": self.val_loss.get(step, 1.0)}

    def checkpoint_groups(self) -> dict:
        return {}

    def cleanups(self) -> list[Callable[[], object]]:
        return []

    def reached_target(self, metrics: dict[str, float]) -> bool:
        return self.target is not None and metrics["val/loss"] <= self.target

    def missed_target(self, history: list[dict[str, float]], step: int) -> None:
        self.missed.append(step)


def _cfg(tmp_path, *extra: str):
    return load_config([], ["trainer.logger=[]", "trainer.resume_mode=disable", "trainer.checkpoint.save_freq=0",
                            f"trainer.run_dir={tmp_path}", "trainer.val_before_train=false", *extra])


def test_validates_at_test_freq_and_last_step_and_reports_a_missed_target(tmp_path):
    algo = FakeAlgorithm({}, {}, target=0.5)
    history = Trainer(_cfg(tmp_path, "trainer.test_freq=4"), algo).fit()
    assert [int(m["training/global_step"]) for m in history if "val/loss" in m] == [4, 6]
    assert [m["training/epoch"] for m in history] == [0, 0, 1, 1, 2, 2]  # the data cycles until total_steps
    assert algo.missed == [6]


def test_reached_target_stops_early(tmp_path):
    algo = FakeAlgorithm({}, {2: 0.4}, target=0.5)
    trainer = Trainer(_cfg(tmp_path, "trainer.test_freq=2"), algo)
    history = trainer.fit()
    assert trainer.global_step == 2 and len(history) == 2 and algo.missed == []


def test_nan_guard_reads_the_algorithms_namespace(tmp_path):
    algo = FakeAlgorithm({2: float("nan"), 3: float("nan")}, {})
    trainer = Trainer(_cfg(tmp_path, "trainer.test_freq=-1", "trainer.max_consecutive_bad_steps=2"), algo)
    with pytest.raises(NonFiniteError, match="max_consecutive_bad_steps"):
        trainer.fit()
    assert [m["train/skipped_steps"] for m in trainer.history] == [0, 1]


def test_resumed_at_total_steps_trains_nothing_and_says_so(tmp_path):
    """Every method (PPO, SFT, RM run this loop): a run resumed at `total_steps` runs no step and no validation,
    and records one `nothing_to_train` event naming the step and the fix."""
    from hybridflow.tracking import Tracker

    algo = FakeAlgorithm({}, {})
    cfg = _cfg(tmp_path, "trainer.test_freq=1")
    events = []
    tracker = Tracker.from_config(cfg)
    tracker.event = lambda kind, message, step, **kw: events.append((kind, message, step))  # type: ignore[method-assign]
    trainer = Trainer(cfg, algo, tracker)
    trainer._resume = lambda: setattr(trainer, "global_step", 6)  # type: ignore[method-assign]
    assert trainer.fit() == [] and trainer.steps_run == 0
    assert [(k, s) for k, _, s in events] == [("nothing_to_train", 6)]
    assert "step 6 of 6" in events[0][1] and "trainer.resume_mode=disable" in events[0][1]
    tracker.close()
