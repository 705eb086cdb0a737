"""Learning on the vision-language task (`colour_count`, examples/colour_count.yaml: `tiny-vl`, a random-init
Qwen2.5-VL), tested by stage so a failure names the stage.

1. SFT: the committed warm start `tests/assets/sft_colour_count` (regenerate: `tests/assets/make_sft_checkpoint.py
   colour_count`; SFT on images, 60% of the demonstrations without the "####" the scorer reads) answers some
   problems right and leaves RL room: its validation success rate (sampled at temperature 1) lies in a range.
2. GRPO with images from that checkpoint (rollouts through whatever path the rollout engine picks for a
   vision-language model) raises the validation success rate by a margin set below the minimum over 5 RL seeds x 2
   CPU numerics (`benchmarks/colour_count_seeds.py`; docs/benchmarks.md, "Vision-language learning").
Every failure message prints the trajectory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks/ is a folder of scripts, not an installed package
from benchmarks.colour_count_seeds import CHECKPOINT, rl_config, rl_run  # noqa: E402

# Stage 1: the checkpoint's validation success rate (128 held-out problems x 2 samples at temperature 1) over the 10
# step-0 validations of the stage-2 sweep: 10.9 / 12.5 / 16.4% (min / median / max) with the HF generate rollout,
# 11.7 / 14.1 / 14.8% with the engine's native one. The counting itself is weak: the same SFT without flawed
# demonstrations reached 50% greedy after 400 steps (one run).
CHECKPOINT_SUCCESS_RANGE = (0.05, 0.30)
# Stage 2: GRPO, 20 steps (16 prompts x 8 samples, lr 2e-4). Over 5 RL seeds x 2 numerics the success rate rose
# +14.1 / +20.7 / +26.2 points (min / median / max) with the HF generate rollout and +16.4 / +19.9 / +23.4 with the
# engine's native vision-language rollout (AVX2 trajectories identical to the default's; docs/benchmarks.md,
# "Vision-language learning"). The bound keeps 4 points (~1.5 sd of 256 samples) below the lower minimum.
GRPO_MIN_GAIN = 0.10


def test_stage1_committed_checkpoint_leaves_rl_something_to_fix(tmp_path: Path) -> None:
    from hybridflow.trainer.ppo import PPOTrainer

    trainer = PPOTrainer(rl_config(tmp_path, "data.train_size=64"))
    try:
        val = trainer.validate()
    finally:
        trainer.close()
    lo, hi = CHECKPOINT_SUCCESS_RANGE
    assert lo <= val["val/accuracy"] <= hi, (
        f"{CHECKPOINT.name}: validation success rate outside [{lo}, {hi}]: "
        f"{ {k: round(v, 3) for k, v in val.items() if k.startswith('val/')} }")


def test_stage2_grpo_with_images_from_sft_checkpoint(tmp_path: Path) -> None:
    res = rl_run(tmp_path)
    acc = [round(a, 3) for a in res["accuracy"]]
    assert len(acc) >= 2, f"GRPO with images: no validation after step 0: {acc}"
    assert res["gain"] >= GRPO_MIN_GAIN, (f"GRPO with images from {CHECKPOINT.name}: validation success rate {acc} "
                                          f"rose {res['gain']:+.3f}, needs >= {GRPO_MIN_GAIN}")
