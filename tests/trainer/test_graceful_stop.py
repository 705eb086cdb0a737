"""A run ends with what it was asked for and with a checkpoint: a step count above one epoch cycles the data (no
silent stop at the epoch's end), the last step validates and saves with `save_freq=-1`, and a stop signal finishes
the step, saves, and resumes to the same final metrics as a run that was never stopped."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
from ppo_testlib import deterministic_metrics, tiny_ppo_config

from hybridflow.checkpoint import atomic
from hybridflow.cli import main as cli_main
from hybridflow.tracking.jsonl import read_events, read_jsonl
from hybridflow.trainer.ppo import PPOTrainer
from hybridflow.trainer.run import run_ppo
from hybridflow.trainer.stop import Interrupted


def _cfg(tmp_path: Path, *extra: str):
    tmp_path.mkdir(parents=True, exist_ok=True)
    return tiny_ppo_config(tmp_path, tmp_path / "ckpt", 2, "trainer.logger=[jsonl]", f"trainer.run_dir={tmp_path}/run",
                           "trainer.checkpoint.async_save=false", *extra)


def _signal_during_step(monkeypatch: pytest.MonkeyPatch, at_step: int, times: int = 1) -> None:
    """Deliver SIGINT to this process while step `at_step` runs (as Ctrl-C would), `times` times."""
    original = PPOTrainer.step

    def step(self: PPOTrainer, batch: Any) -> dict[str, float]:
        if self.global_step == at_step:
            for _ in range(times):
                signal.raise_signal(signal.SIGINT)
        return original(self, batch)

    monkeypatch.setattr(PPOTrainer, "step", step)


def test_step_count_above_one_epoch_cycles_validates_and_saves_at_the_end(tmp_path: Path) -> None:
    # 4 prompts at 2 a step = 2 batches an epoch; total_epochs=1 (default) must not end the run at step 2
    history = run_ppo(_cfg(tmp_path, "data.train_size=4", "trainer.total_training_steps=3",
                           "trainer.checkpoint.save_freq=-1", "actor.optim.lr=1e-6"))
    steps = [int(m["training/global_step"]) for m in history]
    assert steps == [1, 2, 3], steps
    assert any(k.startswith("val/") for k in history[-1]), sorted(history[-1])  # validated at the last step
    latest = atomic.find_latest(tmp_path / "ckpt")
    assert latest is not None and latest.name.endswith("_3"), latest  # "-1 = at the end only" saved the end
    plan = [e for e in read_events(tmp_path / "run") if e["kind"] == "plan"]
    assert plan and plan[0]["message"].startswith("3 steps = 1.50 epochs of 4 rows at 2 prompts a step"), plan
    lr = [e for e in read_events(tmp_path / "run") if e["kind"] == "lr_far_from_rule"]  # 1e-6 on the tiny model
    assert len(lr) == 1 and "× below" in lr[0]["message"], lr


def test_ctrl_c_saves_and_the_rerun_ends_like_an_uninterrupted_run(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    straight = run_ppo(_cfg(tmp_path / "a", "trainer.total_training_steps=4", "trainer.checkpoint.save_freq=-1"))

    cfg = _cfg(tmp_path / "b", "trainer.total_training_steps=4", "trainer.checkpoint.save_freq=-1")
    with monkeypatch.context() as patch:
        _signal_during_step(patch, at_step=2)
        with pytest.raises(Interrupted, match="rerun the same command to resume") as info:
            run_ppo(cfg)
    assert info.value.exit_code == 130
    assert "interrupted by SIGINT at step 2 of 4" in str(info.value)
    latest = atomic.find_latest(tmp_path / "b" / "ckpt")
    assert latest is not None and latest.name.endswith("_2"), latest  # saved although save_freq=-1
    ends = [e for e in read_events(tmp_path / "b" / "run") if e["kind"] == "run_end"]
    assert ends[-1]["status"] == "interrupted", ends

    resumed = run_ppo(cfg)
    assert [int(m["training/global_step"]) for m in resumed] == [3, 4]
    assert deterministic_metrics(resumed[-1]) == deterministic_metrics(straight[-1])
    rows = read_jsonl(tmp_path / "b" / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


def test_second_signal_stops_at_once_without_saving(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg(tmp_path, "trainer.total_training_steps=4", "trainer.checkpoint.save_freq=-1")
    _signal_during_step(monkeypatch, at_step=2, times=2)
    with pytest.raises(Interrupted, match="again while stopping: stopped at once, without saving"):
        run_ppo(cfg)
    assert atomic.find_latest(tmp_path / "ckpt") is None


def test_sigterm_with_checkpoints_off_says_progress_is_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = PPOTrainer.step

    def step(self: PPOTrainer, batch: Any) -> dict[str, float]:
        if self.global_step == 1:
            signal.raise_signal(signal.SIGTERM)
        return original(self, batch)

    monkeypatch.setattr(PPOTrainer, "step", step)
    with pytest.raises(Interrupted, match="save_freq=0") as info:
        run_ppo(_cfg(tmp_path, "trainer.total_training_steps=3", "trainer.checkpoint.save_freq=0"))
    assert info.value.exit_code == 143


def test_cli_says_interrupted_and_exits_with_the_signal_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    import hybridflow.commands.train as run_module

    def interrupted(cfg: Any, tracker: Any = None) -> None:
        raise Interrupted("interrupted by SIGTERM at step 3 of 9; checkpoint saved to X; rerun the same command "
                          "to resume", signal.SIGTERM)

    monkeypatch.setattr(run_module, "run_ppo", interrupted)
    assert cli_main(["train", "--quiet-config", "trainer.device=cpu", "trainer.logger=[jsonl]",
                     f"trainer.run_dir={tmp_path}/run", f"trainer.default_local_dir={tmp_path}/ckpt"]) == 143
    out = capsys.readouterr()
    assert "interrupted" in out.out and "Traceback" not in out.err + out.out


def test_an_interrupt_outside_a_run_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    import hybridflow.commands.report as report_command

    def ctrl_c(args: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(report_command, "run", ctrl_c)
    assert cli_main(["report", "x"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "stopped (Ctrl-C)", err


def test_a_signal_while_closing_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    """SIGTERM while the run waits for its last checkpoint write: the wait completes (an exception thrown into it
    left a half-written checkpoint and the interpreter aborted at exit with the writer thread alive)."""
    from hybridflow.trainer.stop import signals_deferred

    before = signal.getsignal(signal.SIGTERM)
    finished = []
    with signals_deferred("closing the run"):
        signal.raise_signal(signal.SIGTERM)
        finished.append(True)
    assert finished == [True] and signal.getsignal(signal.SIGTERM) is before
    assert any("SIGTERM received while closing the run" in r.getMessage() for r in caplog.records)
