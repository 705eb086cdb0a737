"""What a user sees from the commands: a short line per step, the resolved config named (not dumped), a closing
summary with accuracy before → after and the next command (with the user's config), the same flags everywhere, and
no directory left behind by `eval`. Tiny models on the built-in task: each run takes seconds."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from hybridflow.cli import main

TINY = """
model:
  preset: tiny
  override_config: {{hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2,
                    num_key_value_heads: 1}}
data: {{task: arithmetic, train_size: 64, val_size: 8, max_prompt_length: 16, max_response_length: 4,
        train_batch_size: 4, chat_template: raw}}
actor: {{ppo_mini_batch_size: 4}}
rollout: {{n: 2}}
sft: {{total_steps: 3, batch_size: 8, micro_batch_size_per_gpu: 8}}
dpo: {{total_steps: 2, batch_size: 8}}
trainer:
  device: cpu
  backend: local
  total_training_steps: 3
  test_freq: 2
  cpu_threads: 1
  run_dir: {dir}/run
  default_local_dir: {dir}/ckpt
  checkpoint: {{async_save: false}}
"""
STEP_LINE = re.compile(r"^step \d+")


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "task.yaml"
    path.write_text(TINY.format(dir=tmp_path))
    return path


def _summary(out: str) -> str:
    assert "─ summary ─" in out, out
    return out.split("─ summary ─", 1)[1]


def test_train_prints_short_lines_and_a_summary_with_accuracy_before_and_after(config, tmp_path, capsys) -> None:
    assert main(["train", str(config)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    steps = [line for line in lines if STEP_LINE.match(line)]
    assert [s.split(" ·")[0] for s in steps] == ["step 0 (before training)", "step 1/3", "step 2/3", "step 3/3"]
    assert all(len(s) <= 100 for s in steps), steps
    assert "val/accuracy" in steps[0] and "val/accuracy" in steps[2] and "reward " in steps[1] and "eta " in steps[1]
    # the resolved config is written to the run directory and named in one line, not printed (~400 lines)
    assert f"resolved config: {tmp_path}/run/config.yaml" in out and "ppo_mini_batch_size" not in out
    assert (tmp_path / "run" / "config.yaml").is_file()
    assert len(lines) < 30, out
    summary = _summary(out)
    assert "GRPO training finished: 3 of 3 steps in " in summary
    assert re.search(r"val/accuracy \d+\.\d% → \d+\.\d% \([+-]\d+\.\d points, step 0 → 3\) · best \d+\.\d% at step \d",
                     summary), summary
    assert "greedy" in summary and "reward.success_threshold" in summary
    assert f"checkpoint: {tmp_path}/ckpt/global_step_3" in summary
    assert f"hybridflow export --checkpoint {tmp_path}/ckpt --out {tmp_path}/run_hf" in summary
    assert f"hybridflow eval {config} model.path={tmp_path}/run_hf" in summary  # the user's config: the same task


def test_verbose_prints_the_table_and_the_config(config, capsys) -> None:
    assert main(["train", str(config), "--verbose", "trainer.total_training_steps=1"]) == 0
    out = capsys.readouterr().out
    assert "ppo_mini_batch_size" in out  # the resolved config
    assert "actor/pg_loss" in out and "timing/step" in out  # every metric, as a table


def test_sft_summary_shows_validation_and_the_next_commands_with_the_config(config, tmp_path, capsys) -> None:
    assert main(["sft", str(config), "--quiet-config", "trainer.val_before_train=true"]) == 0
    out = capsys.readouterr().out
    assert "resolved config" not in out
    steps = [line for line in out.splitlines() if STEP_LINE.match(line)]
    assert "val/loss" in steps[0] and "val/loss" in steps[-1] and all(len(s) <= 100 for s in steps)
    summary = _summary(out)
    assert "SFT finished: 3 of 3 steps" in summary and re.search(r"val/loss [\d.]+ → [\d.]+", summary)
    assert f"model (Hugging Face directory): {tmp_path}/run/hf" in summary
    assert f"hybridflow eval {config} trainer.val_before_train=true model.path={tmp_path}/run/hf" in summary
    # RL from the export gets directories of its own (it refuses to resume the SFT checkpoint)
    assert (f"hybridflow train {config} trainer.val_before_train=true model.path={tmp_path}/run/hf "
            f"trainer.run_dir={tmp_path}/run_rl trainer.default_local_dir={tmp_path}/ckpt_rl") in summary


def test_dpo_and_eval_accept_the_flags_and_dpo_hint_names_the_config(config, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["dpo", str(config), "--quiet-config", "--verbose", "data.chat_template=chatml"]) == 0
    summary = _summary(capsys.readouterr().out)
    assert "DPO finished: 2 of 2 steps" in summary
    assert f"hybridflow eval {config} data.chat_template=chatml model.path={tmp_path}/run/hf" in summary
    assert main(["eval", str(config), "--quiet-config", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "evaluation of tiny finished" in out and "val/accuracy" in out and "greedy" in out


def test_eval_leaves_no_checkpoint_directory(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "trainer.device=cpu", "trainer.backend=local", "data.val_size=4",
                 "model.override_config={num_hidden_layers: 1}", "data.max_response_length=4"]) == 0
    assert "val/accuracy" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no checkpoints/hybridflow/default


def test_interrupted_train_says_so_and_how_to_resume(config, tmp_path, capsys, monkeypatch) -> None:
    """Ctrl-C: the summary names the step reached, the metrics so far, the checkpoint and the way to resume."""
    import hybridflow.commands.tracked as tracked
    import hybridflow.commands.train as run_module

    def interrupted_run(cfg, tracker):
        tracker.log({"val/accuracy": 0.125}, 0)
        tracker.start_progress(3)
        tracker.log({"reward/score/mean": 0.2, "val/accuracy": 0.375}, 2)
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "run_ppo", interrupted_run)
    monkeypatch.setattr(tracked, "latest_checkpoint", lambda cfg: tmp_path / "ckpt" / "global_step_2")
    assert main(["train", str(config)]) == 130
    summary = _summary(capsys.readouterr().out)
    assert "GRPO training interrupted at step 2 of 3 after " in summary
    assert "val/accuracy 12.5% → 37.5% (+25.0 points, step 0 → 2)" in summary
    assert f"checkpoint: {tmp_path}/ckpt/global_step_2" in summary and "rerun the same command to resume" in summary
    assert "next:" not in summary


def test_cpu_threads_are_said_once(capsys, caplog) -> None:
    import torch

    from hybridflow.commands.common import load_from_args

    before = torch.get_num_threads()
    caplog.set_level(logging.INFO)
    try:
        load_from_args(["trainer.device=cpu", "trainer.cpu_threads=1"], runs=True)
    finally:
        torch.set_num_threads(before)
    said = capsys.readouterr().err.count("cpu threads:") + sum("cpu threads:" in r.getMessage() for r in caplog.records
                                                               if r.levelno >= logging.INFO)
    assert said == 1
