"""`actor.optim.lr: auto` and the warning for an lr far from what the model's size calls for (verl's 1e-6 on the
0.1M tiny model did not move it in 40 steps, and nothing said so)."""

from __future__ import annotations

import pytest

from hybridflow.config import load_config, to_dict
from hybridflow.config.lr_rule import lr_warning, rule_lr


def test_rule_values() -> None:
    assert rule_lr(7_600_000_000) == pytest.approx(1e-6) and rule_lr(1_500_000_000) == pytest.approx(1e-6)
    assert rule_lr(500_000_000) == pytest.approx(1.414e-6, rel=1e-3)
    assert rule_lr(100_000) == pytest.approx(1e-4)
    assert rule_lr(7_600_000_000, lora=True) == pytest.approx(1e-5)
    assert rule_lr(7_600_000_000, critic=True) == pytest.approx(1e-5)


def test_auto_resolves_from_the_model_shape() -> None:
    tiny = load_config([], ["trainer.device=cpu", "actor.optim.lr=auto", "critic.optim.lr=auto"])
    assert tiny.actor.optim.lr == pytest.approx(9.77e-5, rel=1e-2) and tiny.critic.optim.lr == pytest.approx(9.77e-4,
                                                                                                            rel=1e-2)
    big = load_config([], ["trainer.device=cpu", "model.preset=qwen2.5-7b", "actor.optim.lr=auto"])
    assert big.actor.optim.lr == pytest.approx(1e-6)


def test_warning_names_the_lr_the_size_and_the_fix() -> None:
    default = load_config([], ["trainer.device=cpu"])  # verl's 1e-6 on the tiny model
    message = lr_warning(to_dict(default))
    assert message is not None and "actor.optim.lr=1e-06 is 98× below" in message and "0.1M parameters" in message
    assert "actor.optim.lr=auto" in message
    assert lr_warning(to_dict(load_config([], ["trainer.device=cpu", "actor.optim.lr=1e-4"]))) is None
    assert "above" in (lr_warning(to_dict(load_config([], ["trainer.device=cpu", "model.preset=qwen2.5-7b",
                                                            "actor.optim.lr=1e-3"]))) or "")
    assert lr_warning(to_dict(load_config([], ["trainer.device=cpu", "model.preset=qwen2.5-7b"]))) is None
