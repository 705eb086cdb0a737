"""SFT → RM → PPO with the RM (examples/rlhf_pipeline.py, its defaults: sort task, tiny model, CPU).

Asserted: SFT learns the task format, the RM learns the preference well above chance on held-out pairs, RL on
0.7 RM + 0.3 rule raises the RM score, and the final reward is exactly the weighted mix of the per-source reward
metrics. Not asserted: that RL raises the held-out TRUE metric — with the 0.1M model the RM's quality varies with
its head's initialisation (held-out pair accuracy 0.69-0.92 seen) and so does the true-metric change (+0.17 to
-0.17 seen); see examples/rlhf_pipeline.py and the issue-11 report.
"""

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
def test_rlhf_pipeline_sft_rm_ppo(tmp_path):
    out = _load_example().run_pipeline(tmp_path, rule_weight=0.3)
    assert out["sft_val_token_accuracy"] > 0.8, out
    assert out["rm_val_accuracy"] > 0.6 and out["rm_val_reward_margin"] > 0, out
    assert out["rm_score_last"] > out["rm_score_first"], out
    steps = [m for m in out["ppo_history"] if "reward/model/mean" in m]
    assert len(steps) == 30
    for m in steps:
        assert m["reward/mean"] == pytest.approx(0.7 * m["reward/model/mean"] + 0.3 * m["reward/rule/mean"], abs=1e-4)
