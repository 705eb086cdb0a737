"""Config values that would reach the file system or the YAML parser unchecked: run names that become
directories (no separators, no `..`), and YAML alias bombs (bounded before any walk of the tree)."""

from __future__ import annotations

import time

import pytest

from hybridflow.cli import main
from hybridflow.config import ConfigError, load_config


@pytest.mark.parametrize("override", [
    "trainer.experiment_name=../../../x", "trainer.project_name=a/b", "trainer.experiment_name=..",
    "trainer.project_name=''", "trainer.experiment_name=a\\\\b",
])
def test_names_that_become_paths_stay_one_segment(override, capsys) -> None:
    key, value = override.split("=", 1)
    with pytest.raises(ConfigError) as err:
        load_config([], [override])
    assert key in str(err.value) and "without '/'" in str(err.value) and "trainer.run_dir" in str(err.value)
    assert main(["config", "validate", override]) == 2
    assert key in capsys.readouterr().err


def test_ordinary_names_still_load() -> None:
    cfg = load_config([], ["trainer.experiment_name=grpo-v1.2_run", "trainer.project_name=my.project"])
    assert cfg.trainer.run_dir == "runs/my.project/grpo-v1.2_run"


def _bomb(levels: int) -> str:
    lines = ['l0: &l0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nextra: {{bomb: *l{levels - 1}}}\n"


def test_yaml_alias_bomb_fails_fast(tmp_path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(_bomb(7))  # 9^7 = 4.8M values once expanded
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="expands to more than 200,000 values"):
        load_config([path])
    assert time.perf_counter() - start < 5.0
    levels = ["&a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"] + [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 7)]
    with pytest.raises(ConfigError, match="aliases"):  # the same bomb as one override value
        load_config([], [f"extra.x=[{', '.join(levels)}]"])
    big = tmp_path / "big.yaml"
    big.write_text("extra: {x: '" + "a" * (5 << 20) + "'}\n")
    with pytest.raises(ConfigError, match="MiB"):
        load_config([big])


def test_a_few_aliases_are_fine(tmp_path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text("base: &opt {lr: 1.0e-5}\nactor: {optim: *opt}\ncritic: {optim: *opt}\n".replace("base", "extra"))
    cfg = load_config([path], validate=False)
    assert cfg.actor.optim.lr == cfg.critic.optim.lr == 1e-5
