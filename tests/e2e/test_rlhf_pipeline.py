"""SFT → RM → PPO with the RM on the arithmetic task (examples/rlhf_pipeline.py): the RM learns the preference
(held-out pair accuracy > 0.8) and RL driven by the RM (mixed 0.7 RM + 0.3 rule) raises the held-out TRUE metric
(rule accuracy of greedy answers) and the RM score; the mixing weights show in the reward metrics."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rlhf_pipeline.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("rlhf_pipeline", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_rlhf_pipeline_rm_drives_ppo(tmp_path):
    pipeline = _load_example()
    out = pipeline.run_pipeline(tmp_path, sft_steps=40, rm_steps=40, ppo_steps=12, rule_weight=0.3)
    assert out["rm_val_accuracy"] > 0.8, out
    assert out["true_accuracy_after"] >= out["true_accuracy_before"] + 0.05, out
    assert out["rm_score_last"] > out["rm_score_first"], out
    for m in out["ppo_history"]:
        if "reward/model/mean" in m:
            mixed = 0.7 * m["reward/model/mean"] + 0.3 * m["reward/rule/mean"]
            assert m["reward/mean"] == pytest.approx(mixed, abs=1e-4)
