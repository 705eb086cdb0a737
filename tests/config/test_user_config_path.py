"""The config traps of a user's own task: `reward.custom.path` alone makes the function the reward; `config
validate` checks the files and the function before any model loads (one line each, no traceback); `config show
--diff`; `--quiet-config` anywhere on the command line."""

from __future__ import annotations

import pytest

from hybridflow.cli import main
from hybridflow.config import load_config
from hybridflow.data.parquet_io import write_rows

GOOD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"


def _parquet(path, data_source="my_task"):
    write_rows([{"data_source": data_source, "prompt": [{"role": "user", "content": "1+1"}],
                 "reward_model": {"ground_truth": "2"}}], path)
    return path


def test_custom_path_alone_is_the_reward_source(tmp_path, caplog):
    reward = tmp_path / "r.py"
    reward.write_text(GOOD)
    assert [s.name for s in load_config().reward.sources] == ["rule"]
    cfg = load_config(overrides=[f"reward.custom.path={reward}"])
    assert [(s.name, s.weight) for s in cfg.reward.sources] == [("custom", 1.0)]
    explicit = load_config(overrides=[f"reward.custom.path={reward}", "reward.sources=[{name: rule, weight: 1.0}]"])
    assert [s.name for s in explicit.reward.sources] == ["rule"]
    assert "does not name 'custom'" in caplog.text and "reward.sources" in caplog.text


@pytest.mark.parametrize("reward_src, expected", [
    (None, "reward.custom.path="),  # missing file
    ("import not_a_module_anywhere\n" + GOOD, "failed to import: ModuleNotFoundError"),
    ("def score(a, b):\n    return 1\n", "reward.custom.name='compute_score' is not a function"),
    ("def compute_score(a, b):\n    return 1\n", "has no 'solution_str' parameter"),
    ("def compute_score(solution_str, ground_truth, mode):\n    return 1\n", "cannot be called with verl's"),
])
def test_validate_checks_the_reward_function(tmp_path, capsys, reward_src, expected):
    reward = tmp_path / "r.py"
    if reward_src is not None:
        reward.write_text(reward_src)
    assert main(["config", "validate", f"reward.custom.path={reward}"]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_validate_checks_data_files_and_scorers_before_any_model(tmp_path, capsys, monkeypatch):
    import hybridflow.models.loader as loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("validate loaded a model"))
    data = _parquet(tmp_path / "train.parquet")
    missing = tmp_path / "nope.parquet"
    assert main(["config", "validate", f"data.train_files=[{data}]", f"data.val_files=[{missing}]"]) == 2
    err = capsys.readouterr().err
    assert f"data.val_files: '{missing}' does not exist" in err and "Traceback" not in err
    # a data_source no built-in scorer knows, scored by `rule`: said now, not after the model loaded
    assert main(["config", "validate", f"data.train_files=[{data}]"]) == 2
    err = capsys.readouterr().err
    assert "['my_task']" in err and "reward.custom.path" in err
    reward = tmp_path / "r.py"
    reward.write_text(GOOD)
    assert main(["config", "validate", f"data.train_files=[{data}]", f"reward.custom.path={reward}",
                 "data.train_batch_size=1", "actor.ppo_mini_batch_size=1"]) == 0  # a batch fits in its 1 row
    assert "config is valid" in capsys.readouterr().out
    # the training commands run the same checks first
    assert main(["train", f"data.train_files=[{missing}]"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_config_show_diff(capsys):
    assert main(["config", "show", "--diff"]) == 0
    assert capsys.readouterr().out.strip() == "# same as the defaults"
    assert main(["config", "show", "--diff", "rollout.n=3", "actor.optim.lr=2e-5"]) == 0
    assert capsys.readouterr().out.split() == ["actor:", "optim:", "lr:", "2.0e-05", "rollout:", "n:", "3"]


def test_quiet_config_anywhere(tmp_path, monkeypatch, capsys):
    import hybridflow.commands.train as run

    seen = []
    monkeypatch.setattr(run, "run_ppo", lambda cfg, tracker=None: seen.append(cfg))
    monkeypatch.chdir(tmp_path)  # the default run directory is relative
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("rollout: {n: 2}\n")
    for argv in (["train", "--quiet-config", str(cfg_file), "data.train_batch_size=64"],
                 ["train", str(cfg_file), "--quiet-config", "data.train_batch_size=64"],
                 ["train", str(cfg_file), "data.train_batch_size=64", "--quiet-config"]):
        assert main(argv) == 0
        assert seen[-1].rollout.n == 2 and seen[-1].data.train_batch_size == 64
        assert "actor:" not in capsys.readouterr().out  # the config was not printed
    with pytest.raises(SystemExit):
        main(["train", str(cfg_file), "--no-such-flag"])
