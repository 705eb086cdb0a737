"""`reward.overlap` (issue 25 item 4): the driver scores on the host while the workers compute old / reference
log-probs and values on a thread. The run is the same as scoring first (every metric but timings bit-equal, same
weights), the worker stages really run beside the reward, and configs whose reward needs a worker (a reward model)
or drives a decision (DAPO's group filter) stay in order."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from ppo_testlib import tiny_ppo_config

from hybridflow.trainer.ppo import PPOAlgorithm, PPOTrainer

GAE_KL = ("algorithm.adv_estimator=gae", "actor.use_kl_loss=true", "trainer.total_training_steps=3",
          "trainer.checkpoint.save_freq=0")
_WORKER_STAGES = PPOAlgorithm._worker_stages


def _run(tmp_path: Path, overlap: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[dict], set[str]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    threads: set[str] = set()

    def spy(self, *args, **kwargs):
        threads.add(threading.current_thread().name)
        return _WORKER_STAGES(self, *args, **kwargs)

    monkeypatch.setattr(PPOAlgorithm, "_worker_stages", spy)
    cfg = tiny_ppo_config(tmp_path, tmp_path / "ckpt", 1, f"reward.overlap={str(overlap).lower()}", *GAE_KL)
    trainer = PPOTrainer(cfg)
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    return history, threads


def _untimed(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(("timing/", "perf/")) and "time" not in k and "per_s" not in k
             and "throughput" not in k} for m in history]


def test_overlap_runs_the_worker_stages_beside_the_reward_and_changes_nothing(tmp_path, monkeypatch):
    seq, seq_threads = _run(tmp_path / "seq", False, monkeypatch)
    ovl, ovl_threads = _run(tmp_path / "ovl", True, monkeypatch)
    assert seq_threads == {threading.main_thread().name}
    assert len(ovl_threads) == 1 and next(iter(ovl_threads)).startswith("worker-stages")
    assert len(seq) == len(ovl) == 3  # step 2's losses depend on step 1's update: equal weights in between
    for a, b in zip(_untimed(seq), _untimed(ovl)):
        assert a.keys() == b.keys()
        diff = {k: (a[k], b[k]) for k in a if a[k] != b[k] and not (a[k] != a[k] and b[k] != b[k])}  # NaN == NaN
        assert not diff, diff
    for key in ("timing/old_log_prob", "timing/ref", "timing/values", "timing/reward"):
        assert key in ovl[0], key


def test_overlap_is_skipped_where_the_reward_must_come_first(tmp_path):
    base = tiny_ppo_config(tmp_path, tmp_path / "ckpt", 1, *GAE_KL)
    decide = lambda *o: PPOAlgorithm._overlap_reward(_Stub(tiny_ppo_config(tmp_path, tmp_path / "ckpt", 1, *GAE_KL, *o)))  # noqa: E731
    assert decide() is True
    assert decide("reward.overlap=false") is False
    assert decide("algorithm.filter_groups.enable=true") is False
    assert decide("reward.sources=[{name: model, weight: 1.0}]", "reward.reward_model.enable=true") is False
    grpo_no_stage = tiny_ppo_config(tmp_path, tmp_path / "ckpt", 1, "algorithm.adv_estimator=grpo",
                                    "actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false",
                                    "actor.ppo_mini_batch_size=2")
    assert PPOAlgorithm._overlap_reward(_Stub(grpo_no_stage)) is False  # nothing to overlap with
    assert base.reward.overlap is True  # on by default


class _Stub:
    def __init__(self, cfg) -> None:
        from hybridflow.config import resolve

        self.cfg, self.res = cfg, resolve(cfg)
