"""SFT → comparisons → RM → GRPO with the RM (examples/rlhf_pipeline.py, its defaults: sort task, tiny model, CPU).

Asserted: SFT learns the task format; the RM, trained on wrong answers SAMPLED from the SFT model and labelled by
the rule (the RLHF way), ranks held-out pairs with accuracy > 0.8; RL on 0.7 RM + 0.3 rule (KL loss 0.1 to the
SFT model) raises the RM score and the held-out TRUE metric (greedy exact accuracy on 64 held-out prompts, scored
by the rule only) by at least 0.10; the final reward is exactly the weighted mix of the per-source reward metrics.
Measured on 2 CPU cores (trainer.seed 0/2/3): RM 0.91/0.95/0.95, true accuracy 0.25 → 0.52/0.47/0.45; with the
RM alone (no rule reward) 0.25 → 0.50 (seed 0). See examples/rlhf_pipeline.py and docs/benchmarks.md.
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
    assert out["rm_pairs"] == "sampled"
    assert out["rm_val_accuracy"] > 0.8 and out["rm_val_reward_margin"] > 0, out
    steps = [m for m in out["ppo_history"] if "reward/model/mean" in m]
    assert len(steps) == 30
    rm = [m["reward/model/mean"] for m in steps]
    assert sum(rm[-5:]) / 5 > sum(rm[:5]) / 5, rm  # single steps are noisy: compare the first and last five
    for m in steps:
        assert m["reward/mean"] == pytest.approx(0.7 * m["reward/model/mean"] + 0.3 * m["reward/rule/mean"], abs=1e-4)
    # The TRUE metric (rule-scored greedy accuracy on held-out prompts) rises by a stated margin.
    assert out["true_accuracy_after"] >= out["true_accuracy_before"] + 0.10, out
