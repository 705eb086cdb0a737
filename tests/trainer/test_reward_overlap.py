"""`reward.overlap`: the driver scores on the host while the workers compute old / reference
log-probs and values on a thread. The run is the same as scoring first (every metric but timings bit-equal, same
weights), the worker stages really run beside the reward, and configs whose reward needs a worker (a reward model)
or drives a decision (DAPO's group filter) stay in order."""

from __future__ import annotations

import threading
import types
from pathlib import Path

import pytest
from ppo_testlib import tiny_ppo_config

from hybridflow.engine.train_engine import TrainEngine
from hybridflow.protocol import keys
from hybridflow.trainer.ppo import PPOAlgorithm, PPOTrainer
from hybridflow.trainer.stage_schedule import Overlap, plan_overlap
from hybridflow.trainer.timing import StageTimer

GAE_KL = ("algorithm.adv_estimator=gae", "actor.use_kl_loss=true", "trainer.total_training_steps=3",
          "trainer.checkpoint.save_freq=0")
_ORIGINAL = (TrainEngine._forward_micro, PPOAlgorithm.update_actor, PPOAlgorithm.reward)


def _run(tmp_path: Path, overlap: bool, monkeypatch: pytest.MonkeyPatch, *extra: str
         ) -> tuple[list[dict], set[str], list[str]]:
    """Three PPO-GAE steps with KL: (metrics, threads the worker stages 3-5 ran on, events in order: each forward
    and each scoring with its thread)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    threads: set[str] = set()
    events: list[str] = []
    for name in ("old_log_prob", "ref_log_prob", "values"):
        def spy(self, *args, _stage=getattr(PPOAlgorithm, name), **kwargs):
            threads.add(threading.current_thread().name)
            return _stage(self, *args, **kwargs)

        monkeypatch.setattr(PPOAlgorithm, name, spy)
    _spy_forwards_and_scoring(monkeypatch, events)
    cfg = tiny_ppo_config(tmp_path, tmp_path / "ckpt", 1, f"reward.overlap={str(overlap).lower()}", *GAE_KL, *extra)
    trainer = PPOTrainer(cfg)
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    return history, threads, events


def _spy_forwards_and_scoring(monkeypatch: pytest.MonkeyPatch, events: list[str]) -> None:
    """Append "forward" for each training-engine forward and "reward:<thread>" for each scoring to `events`."""
    forward, _, reward = _ORIGINAL  # not the spies of an earlier run in the same test

    def forward_spy(self, *args, **kwargs):
        events.append("forward")
        return forward(self, *args, **kwargs)

    def reward_spy(self, *args, **kwargs):
        events.append(f"reward:{threading.current_thread().name}")
        return reward(self, *args, **kwargs)

    monkeypatch.setattr(TrainEngine, "_forward_micro", forward_spy)
    monkeypatch.setattr(PPOAlgorithm, "reward", reward_spy)


def _untimed(history: list[dict]) -> list[dict]:
    """Metrics without the ones computed from wall time (timings, throughput, MFU: the last only on a GPU)."""
    return [{k: v for k, v in m.items() if not k.startswith(("timing/", "perf/")) and "time" not in k and "per_s" not in k
             and "throughput" not in k and not k.endswith("/mfu")} for m in history]


def test_overlap_scores_inside_the_first_worker_stage_and_changes_nothing(tmp_path, monkeypatch):
    """In-process workers: the stages run on the driver's thread and the first one (old log-probs) calls the scoring
    back once its forwards are queued, before its outputs come to the host. Same run as scoring first."""
    seq, seq_threads, seq_events = _run(tmp_path / "seq", False, monkeypatch)
    ovl, ovl_threads, ovl_events = _run(tmp_path / "ovl", True, monkeypatch)
    main = threading.main_thread().name
    assert seq_threads == ovl_threads == {main}
    n_steps = 3
    per_step = len(seq_events) // n_steps
    assert seq_events[0] == f"reward:{main}" and seq_events.count(f"reward:{main}") == n_steps
    first = ovl_events[:per_step]
    assert first[0] == "forward" and first.count(f"reward:{main}") == 1
    assert "forward" in first[first.index(f"reward:{main}") + 1:]  # later stages and the updates come after
    assert sorted(ovl_events) == sorted(seq_events)
    assert len(seq) == len(ovl) == n_steps  # step 2's losses depend on step 1's update: equal weights in between
    for a, b in zip(_untimed(seq), _untimed(ovl)):
        assert a.keys() == b.keys()
        diff = {k: (a[k], b[k]) for k in a if a[k] != b[k] and not (a[k] != a[k] and b[k] != b[k])}  # NaN == NaN
        assert not diff, diff
    for key in ("timing/old_log_prob", "timing/ref", "timing/values", "timing/reward"):
        assert key in ovl[0], key


def test_overlap_runs_the_worker_stages_on_a_thread_for_out_of_process_workers(tmp_path, monkeypatch):
    """Workers in other processes (Ray) cannot call back into the driver: the stages run on a thread there while
    the driver scores. Checked with the local workers made to look remote; the run is the same as scoring first."""
    from hybridflow.controller.worker_group import WorkerGroup

    seq, _, _ = _run(tmp_path / "seq", False, monkeypatch)
    monkeypatch.setattr(WorkerGroup, "backend_kind", property(lambda self: "remote-for-test"))
    ovl, ovl_threads, _ = _run(tmp_path / "ovl", True, monkeypatch)
    assert len(ovl_threads) == 1 and next(iter(ovl_threads)).startswith("worker-stages")
    for a, b in zip(_untimed(seq), _untimed(ovl)):
        diff = {k: (a[k], b[k]) for k in a if a[k] != b[k] and not (a[k] != a[k] and b[k] != b[k])}
        assert not diff, diff


def test_a_failing_reward_inside_a_worker_stage_is_the_error_raised(tmp_path, monkeypatch):
    """The scoring fails inside the old-log-prob stage's call (it was handed the scoring): its own error comes out."""
    inside: list[bool] = []
    old_log_prob = PPOAlgorithm.old_log_prob

    def broken(self, batch, metrics):
        inside.append(True)
        raise ValueError("reward function broke on row 5")

    def stage_spy(self, batch, metrics, beside=None):
        spied = None if beside is None else (lambda: (inside.append(False), beside())[1])
        return old_log_prob(self, batch, metrics, spied)

    monkeypatch.setattr(PPOAlgorithm, "reward", broken)
    monkeypatch.setattr(PPOAlgorithm, "old_log_prob", stage_spy)
    cfg = tiny_ppo_config(tmp_path, tmp_path / "ckpt", 1, *GAE_KL)
    trainer = PPOTrainer(cfg)
    try:
        with pytest.raises(ValueError, match="broke on row 5"):
            trainer.fit()
    finally:
        trainer.close()
    assert inside == [False, True]  # the stage called what it was handed beside it, which ran the scoring


def _plan(cfg, backend: str = "local", driver: object = None) -> Overlap | None:
    """What `run_stages` overlaps in a step of `cfg` (the stage list of an algorithm built without workers)."""
    from types import SimpleNamespace

    from hybridflow.config import resolve

    alg = PPOAlgorithm.__new__(PPOAlgorithm)
    alg.cfg, alg.res, alg.driver = cfg, resolve(cfg), driver
    alg.groups = SimpleNamespace(actor=SimpleNamespace(worker_group=SimpleNamespace(backend_kind=backend)))
    return plan_overlap(alg.stages(1, StageTimer()), alg.in_process)


def _names(plan: Overlap | None) -> tuple[tuple[str, ...], tuple[str, ...], bool] | None:
    return None if plan is None else (tuple(s.name for s in plan.held), tuple(c.name for c in plan.calls), plan.late)


def test_overlap_is_skipped_where_the_reward_must_come_first(tmp_path):
    base = tiny_ppo_config(tmp_path, tmp_path / "ckpt", 1, *GAE_KL)
    decide = lambda *o, **kw: _names(_plan(tiny_ppo_config(tmp_path, tmp_path / "ckpt", 1, *GAE_KL, *o), **kw))  # noqa: E731
    assert decide() == (("reward",), ("old_log_prob", "ref", "values"), False)
    assert decide(backend="ray") == decide()  # on a thread there (see above)
    assert decide("reward.overlap=false") is None
    assert decide("algorithm.filter_groups.enable=true") is None
    assert decide("reward.sources=[{name: model, weight: 1.0}]", "reward.reward_model.enable=true") is None
    assert decide("critic.warmup_steps=1") == (("reward",), ("old_log_prob", "ref", "values"), False)
    assert base.reward.overlap is True  # on by default


GRPO_NO_STAGE = ("algorithm.adv_estimator=grpo", "actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false",
                 "trainer.total_training_steps=3", "trainer.checkpoint.save_freq=0")


def _run_grpo(tmp_path: Path, overlap: bool, monkeypatch: pytest.MonkeyPatch, *extra: str
              ) -> tuple[list[dict], list[str]]:
    """Three on-policy GRPO steps (one mini-batch: no stage 3-5); `events` records, in order, each training forward,
    each time the update asked for its late columns, and each scoring with its thread."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    events: list[str] = []
    update = _ORIGINAL[1]

    def update_spy(self, batch, metrics, late=None):
        def wait():
            events.append("late")
            return late()

        return update(self, batch, metrics, None if late is None else wait)

    _spy_forwards_and_scoring(monkeypatch, events)
    monkeypatch.setattr(PPOAlgorithm, "update_actor", update_spy)
    cfg = tiny_ppo_config(tmp_path, tmp_path / "ckpt", 2, f"reward.overlap={str(overlap).lower()}",
                          *GRPO_NO_STAGE, *extra)
    trainer = PPOTrainer(cfg)
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    return history, events


def test_grpo_without_worker_stages_scores_during_the_update_and_changes_nothing(tmp_path, monkeypatch):
    """With nothing else to overlap with, the host scores while the actor update's first forward runs (late
    columns): the update asks for the advantages only after queuing that forward. Same run as in order."""
    seq, seq_events = _run_grpo(tmp_path / "seq", False, monkeypatch, "actor.ppo_micro_batch_size_per_gpu=4")
    ovl, ovl_events = _run_grpo(tmp_path / "ovl", True, monkeypatch, "actor.ppo_micro_batch_size_per_gpu=4")
    main = f"reward:{threading.main_thread().name}"
    assert seq_events == [main, "forward", "forward"] * 3
    # each step: the first micro-batch's forward is queued, then the update asks for its advantages and the host
    # scores (on the main thread: no GIL contention with the update's kernel launches), then the second micro-batch
    # (8 rows / 4 a micro-batch)
    assert ovl_events == ["forward", "late", main, "forward"] * 3
    assert len(seq) == len(ovl) == 3
    for a, b in zip(_untimed(seq), _untimed(ovl)):
        assert a.keys() == b.keys()
        diff = {k: (a[k], b[k]) for k in a if a[k] != b[k] and not (a[k] != a[k] and b[k] != b[k])}
        assert not diff, diff
    assert "timing/reward" in ovl[0] and "timing/adv" in ovl[0]


def test_scoring_during_the_update_needs_one_pass_one_process_and_no_worker_stage(tmp_path, monkeypatch):
    decide = lambda *o, **kw: _names(_plan(tiny_ppo_config(tmp_path, tmp_path / "ckpt", 2, *GRPO_NO_STAGE, *o),  # noqa: E731
                                           **kw))
    monkeypatch.setenv(keys.CHECK_ENV, "1")  # the update's check reads the batch its late columns complete
    assert decide() == (("reward", "adv"), ("update_actor",), True)
    assert decide("reward.overlap=false") is None
    # the first forward of epoch 2 needs epoch 1's advantages; 2 mini-batches: old log-probs recomputed (stage 3)
    assert decide("actor.ppo_epochs=2") == (("reward",), ("old_log_prob",), False)
    assert decide("actor.ppo_mini_batch_size=1") == (("reward",), ("old_log_prob",), False)
    assert decide("actor.use_kl_loss=true") == (("reward",), ("ref",), False)  # overlapped there (no old-policy pass)
    assert decide("algorithm.adv_estimator=gae") == (("reward",), ("values",), False)  # critic values: there
    assert decide("algorithm.filter_groups.enable=true") is None
    assert decide("reward.sources=[{name: model, weight: 1.0}]", "reward.reward_model.enable=true") is None
    assert decide(backend="ray") is None  # the update runs in another process: it cannot call back for columns
    # one_step_off / async: the batch was generated ahead (and, with DAPO, scored on arrival)
    assert decide(driver=types.SimpleNamespace(scores=False)) is None


def test_a_failing_reward_during_the_update_is_the_error_raised(tmp_path, monkeypatch):
    def broken(self, batch, metrics):
        raise ValueError("reward function broke on row 3")

    monkeypatch.setattr(PPOAlgorithm, "reward", broken)
    cfg = tiny_ppo_config(tmp_path, tmp_path / "ckpt", 2, *GRPO_NO_STAGE)
    trainer = PPOTrainer(cfg)
    try:
        with pytest.raises(ValueError, match="reward function broke on row 3"):
            trainer.fit()
    finally:
        trainer.close()
