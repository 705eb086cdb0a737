"""Every example config loads and validates (a renamed key would otherwise surface only when a user runs it)."""

from pathlib import Path

import pytest

from hybridflow.config import load_config

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def test_there_are_examples():
    assert len(EXAMPLES) >= 4


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_validates(path):
    cfg = load_config([path])
    assert (cfg.trainer.total_training_steps or 0) > 0 or cfg.trainer.total_epochs > 0


def test_own_task_example_validates_for_sft_and_train(tmp_path, monkeypatch, capsys):
    """The README's own-task walkthrough: its data script, config and reward pass `config validate` (columns from
    the parquet schema, the reward's signature, the step plan)."""
    import runpy

    from hybridflow.cli import main

    own = Path(__file__).resolve().parents[2] / "examples" / "own_task"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["make_data.py", "data"])
    runpy.run_path(str(own / "make_data.py"), run_name="__main__")
    assert main(["config", "validate", str(own / "my_task.yaml"), f"reward.custom.path={own / 'my_reward.py'}"]) == 0
    out = capsys.readouterr().out
    assert "30 steps = 1.07 epochs of 900 rows at 32 prompts a step" in out, out
