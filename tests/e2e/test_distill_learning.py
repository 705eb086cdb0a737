"""On-policy distillation learns: the committed noisy warm start (`tests/assets/sft_arithmetic`, which prefers
"answer + 1") distilled from the noise-free SFT teacher (`tests/assets/sft_arithmetic_clean`, regenerate:
`tests/assets/make_sft_checkpoint.py arithmetic_clean`) with no task reward closes most of their greedy-accuracy gap
in `STEPS` steps. The margin is set below the minimum over 5 seeds x 2 CPU numerics (`benchmarks/distill_seeds.py`;
docs/benchmarks.md, "Distillation learning"). The failure message prints the trajectory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks/ is a folder of scripts, not an installed package
from benchmarks.distill_seeds import STEPS, distill, gap_closed  # noqa: E402

# Share of the student-teacher greedy-accuracy gap closed in STEPS = 5 steps, below the minimum seen: over 5 seeds x 2
# numerics 17.6% -> 99.6% in every run with the teacher at 94.5%, 106.6% of the gap (the student passes its teacher);
# at 10 steps 98.4 / 98.4 / 99.2% (min / median / max), 105.1 / 105.1 / 106.1% (docs/benchmarks.md).
MIN_GAP_CLOSED = 0.90


def test_distillation_closes_most_of_the_gap_to_the_teacher(tmp_path: Path) -> None:
    res = distill(tmp_path)
    acc, teacher = res["accuracy"], res["teacher_accuracy"]
    assert len(acc) >= 2, f"no validation after step 0: {acc}"
    closed = gap_closed(res)
    assert closed >= MIN_GAP_CLOSED, (
        f"distillation in {STEPS} steps: student accuracy {[round(a, 3) for a in acc]}, teacher {teacher:.3f}: "
        f"{closed:.1%} of the gap closed, needs >= {MIN_GAP_CLOSED:.0%}; distill/reverse_kl "
        f"{[round(k, 3) for k in res['reverse_kl']]}")
