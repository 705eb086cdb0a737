"""Honest run status: every trainer closes its run in one place. `run_end` says `failed` for a
NonFiniteError stop (PPO said `finished`), `interrupted` for Ctrl-C and SIGTERM; a failing cleanup never replaces
the run's own error; a resume into the same run directory logs each step once (item 5)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
from ppo_testlib import SimulatedCrash, tiny_ppo_config

from hybridflow.config import load_config
from hybridflow.tracking.health import NonFiniteError
from hybridflow.tracking.jsonl import read_events, read_jsonl
from hybridflow.trainer.ppo import PPOTrainer
from hybridflow.trainer.run import run_ppo
from hybridflow.trainer.sft import SFTTrainer
from hybridflow.trainer.stop import Interrupted, run_cleanups
from hybridflow.trainer.supervised import run_supervised


def _ppo_cfg(tmp_path: Path, *extra: str):
    return tiny_ppo_config(tmp_path, tmp_path / "ckpt", 2, "trainer.logger=[]", f"trainer.run_dir={tmp_path}/run",
                           "trainer.checkpoint.async_save=false", "trainer.total_training_steps=2",
                           "trainer.checkpoint.save_freq=0", *extra)


def _run_end(run_dir: Path) -> dict[str, Any]:
    ends = [e for e in read_events(run_dir) if e["kind"] == "run_end"]
    assert ends, f"no run_end in {run_dir}/events.jsonl"
    return ends[-1]


def _step_raising(monkeypatch: pytest.MonkeyPatch, cls: type, method: str, at_step: int, action: Any) -> None:
    original = getattr(cls, method)

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.global_step >= at_step:
            action()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, wrapped)


def test_ppo_non_finite_stop_is_recorded_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hybridflow.workers.actor_rollout_ref as actor_module

    make_loss = actor_module.make_actor_loss

    def nan_actor_loss(*args: Any, **kwargs: Any):
        loss_fn = make_loss(*args, **kwargs)
        return lambda outputs, batch, norms: (lambda v, m: (v * float("nan"), m))(*loss_fn(outputs, batch, norms))

    monkeypatch.setattr(actor_module, "make_actor_loss", nan_actor_loss)
    cfg = _ppo_cfg(tmp_path, "trainer.max_consecutive_bad_steps=1")
    with pytest.raises(NonFiniteError):
        run_ppo(cfg)
    end = _run_end(tmp_path / "run")
    assert end["status"] == "failed" and end["level"] == "error", end
    assert end["error_type"] == "NonFiniteError" and "max_consecutive_bad_steps" in end["error"]


def test_ppo_ctrl_c_is_recorded_interrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def ctrl_c() -> None:
        raise KeyboardInterrupt

    _step_raising(monkeypatch, PPOTrainer, "step", 2, ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        run_ppo(_ppo_cfg(tmp_path))
    end = _run_end(tmp_path / "run")
    assert end["status"] == "interrupted" and end["step"] == 1 and end["error_type"] == "KeyboardInterrupt", end


def _sft_cfg(tmp_path: Path, *extra: str):
    return load_config([], [
        "trainer.device=cpu", "trainer.backend=local", "trainer.logger=[]", f"trainer.run_dir={tmp_path}/run",
        f"trainer.default_local_dir={tmp_path}/ckpt", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.checkpoint.save_freq=0", "model.override_config={num_hidden_layers: 1}", "data.train_size=16",
        "data.val_size=4", "sft.batch_size=4", "sft.micro_batch_size_per_gpu=4", "sft.total_steps=3", *extra])


class _TestSigterm(Exception):
    """What SIGTERM raises under this test's own handler: seen only where no trainer handler replaced it."""


def test_sft_sigterm_is_recorded_interrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def test_handler(signum: int, frame: Any) -> None:  # keeps pytest alive where SIGTERM would kill it
        raise _TestSigterm

    previous = signal.signal(signal.SIGTERM, test_handler)
    try:
        _step_raising(monkeypatch, SFTTrainer, "_log", 1, lambda: signal.raise_signal(signal.SIGTERM))
        with pytest.raises(Interrupted, match="interrupted by SIGTERM at step 1") as info:
            run_supervised(SFTTrainer, _sft_cfg(tmp_path))
        assert signal.getsignal(signal.SIGTERM) is test_handler  # restored after the run
    finally:
        signal.signal(signal.SIGTERM, previous)
    end = _run_end(tmp_path / "run")
    assert end["status"] == "interrupted" and end["error_type"] == "Interrupted", end
    assert info.value.exit_code == 143


def test_cleanup_failure_is_a_note_on_the_original_error() -> None:
    calls: list[str] = []

    def dead_group_close() -> None:
        calls.append("close_checkpoints")
        raise RuntimeError("worker group 'actor', method 'close_checkpoints', rank 1: dead")

    original = ValueError("the failing call")
    run_cleanups([dead_group_close, lambda: calls.append("shutdown")], original)
    assert calls == ["close_checkpoints", "shutdown"]  # the release still runs
    assert "close_checkpoints" in original.__notes__[0]
    with pytest.raises(RuntimeError, match="close_checkpoints") as info:  # no run error: the cleanup's is raised
        run_cleanups([dead_group_close, dead_group_close])
    assert len(info.value.__notes__) == 1


def test_ppo_resume_into_same_run_dir_logs_each_step_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 20: after a kill and a resume, metrics.jsonl had steps 1..6, 6, 7, 8."""
    cfg = _ppo_cfg(tmp_path, "trainer.total_training_steps=4", "trainer.checkpoint.save_freq=2")

    def crash() -> None:
        raise SimulatedCrash("killed after logging step 3, before its checkpoint")

    with monkeypatch.context() as patch:
        _step_raising(patch, PPOTrainer, "step", 4, crash)  # steps 1-3 logged, checkpoint at 2
        with pytest.raises(SimulatedCrash):
            run_ppo(cfg)
    run_ppo(cfg)  # resumes at step 2 into the same run directory
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    ends = [e["status"] for e in read_events(tmp_path / "run") if e["kind"] == "run_end"]
    assert ends == ["failed", "finished"]  # both attempts stay visible
