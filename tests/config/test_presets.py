"""`algorithm.preset`: the preset's values apply, and values the user sets in the layer naming it (or later) win."""

from __future__ import annotations

import pytest
import yaml

from hybridflow.config import ConfigError, load_config
from hybridflow.config.loader import get_dotted, parse_override
from hybridflow.config.presets import ALGORITHM_PRESETS


def _value(cfg: object, key: str) -> object:
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _robust() -> list[tuple[str, object]]:
    return [parse_override(item) for item in ALGORITHM_PRESETS["robust"]]


def test_default_is_no_preset() -> None:
    assert load_config().algorithm.preset is None


def test_robust_preset_sets_every_value_it_lists() -> None:
    cfg = load_config(overrides=["algorithm.preset=robust"])
    assert cfg.algorithm.preset == "robust"
    for key, value in _robust():
        assert _value(cfg, key) == value, key
    changed = [key for key, value in _robust() if _value(load_config(), key) != value]
    assert changed, "the robust preset must change at least one default"


def test_explicit_overrides_win_over_the_preset(tmp_path) -> None:
    key, value = _robust()[0]
    mine = value * 3 if isinstance(value, (int, float)) else value
    # on the command line, before or after the preset
    for order in ([f"{key}={mine}", "algorithm.preset=robust"], ["algorithm.preset=robust", f"{key}={mine}"]):
        assert _value(load_config(overrides=order), key) == mine, order
    # in the same file as the preset
    section, leaf = key.rsplit(".", 1)
    tree: dict = {"algorithm": {"preset": "robust"}}
    node = tree
    for part in section.split("."):
        node = node.setdefault(part, {})
    node[leaf] = mine
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(tree))
    assert _value(load_config([path]), key) == mine
    assert get_dotted(tree, key) == mine


def test_preset_on_the_command_line_replaces_earlier_files(tmp_path) -> None:
    key, value = _robust()[-1]
    section, leaf = key.rsplit(".", 1)
    tree: dict = {}
    node = tree
    for part in section.split("."):
        node = node.setdefault(part, {})
    node[leaf] = value * 7 if isinstance(value, (int, float)) else value
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(tree))
    assert _value(load_config([path], ["algorithm.preset=robust"]), key) == value


def test_unknown_preset_names_the_key_and_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"algorithm.preset='fast'.*robust"):
        load_config(overrides=["algorithm.preset=fast"])
