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
