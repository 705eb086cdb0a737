"""On-policy distillation on the quickstart task, over seeds × CPU numerics: the numbers behind the margin of
tests/e2e/test_distill_learning.py (docs/benchmarks.md, "Distillation learning").

    python -m benchmarks.distill_seeds --seeds 0-4 --numerics default,avx2 --jobs 1 --out runs/distill_seeds [k=v ...]

The student is the committed noisy warm start `tests/assets/sft_arithmetic` (70% of its demonstrations answer one
too high); the teacher is `tests/assets/sft_arithmetic_clean` (the same SFT recipe without the noise). No task reward
reaches the student (`teacher.task_reward_weight=0`): it learns from the teacher's log-probs alone. Each run is in its
own process with one intra-op thread, RL seeds shifted by `s` (rollout.seed=s, trainer.seed=s+1). Per run: the
student's greedy validation accuracy before and after, the teacher's, the share of the gap closed, time. Output:
`<out>/runs.jsonl` (a line per run, appended as runs finish) and a min / median / max table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]
STUDENT = ROOT / "tests" / "assets" / "sft_arithmetic"
TEACHER = ROOT / "tests" / "assets" / "sft_arithmetic_clean"
STEPS = 5  # the test's; the sweep in docs/benchmarks.md ran 10 (trainer.total_training_steps=10 trainer.test_freq=5)
DISTILL = ("algorithm.adv_estimator=distill", f"teacher.model_path={TEACHER}", f"trainer.total_training_steps={STEPS}",
           f"trainer.test_freq={STEPS}")


def _config(run_dir: Path, *overrides: str) -> Any:
    from hybridflow.commands.quickstart import QUICKSTART_YAML
    from hybridflow.config import load_config

    return load_config([QUICKSTART_YAML], [f"model.path={STUDENT}", f"trainer.run_dir={run_dir}",
                                           f"trainer.default_local_dir={run_dir}/ckpt", "trainer.logger=[jsonl]",
                                           *overrides])


def teacher_accuracy(run_dir: Path, *overrides: str) -> float:
    """The teacher's greedy validation accuracy on the quickstart's held-out problems (`overrides` but the teacher's
    own keys: here the teacher is the policy)."""
    from hybridflow.trainer.ppo import PPOTrainer

    own = [o for o in overrides if not o.startswith("teacher.")]
    trainer = PPOTrainer(_config(run_dir / "teacher", *own, f"model.path={TEACHER}"))
    try:
        return trainer.validate()["val/accuracy"]
    finally:
        trainer.close()


def distill(run_dir: Path, *overrides: str) -> dict[str, Any]:
    """Student validation accuracies (step 0, then every `trainer.test_freq`) while distilling from the teacher, and
    the teacher's accuracy."""
    from hybridflow.trainer.run import run_ppo

    history = run_ppo(_config(run_dir, *DISTILL, *overrides))
    acc = [m["val/accuracy"] for m in history if "val/accuracy" in m]
    return {"accuracy": acc, "teacher_accuracy": teacher_accuracy(run_dir, *overrides),
            "reverse_kl": [m["distill/reverse_kl"] for m in history if "distill/reverse_kl" in m]}


def gap_closed(res: dict[str, Any]) -> float:
    acc, teacher = res["accuracy"], res["teacher_accuracy"]
    return (acc[-1] - acc[0]) / max(teacher - acc[0], 1e-9)


def launch(out: Path, seed: int, numerics: str, overrides: list[str]) -> dict[str, Any]:
    run_dir = out / f"{numerics}_s{seed}"
    cmd = [sys.executable, "-m", "benchmarks.distill_seeds", "--child", str(run_dir), f"rollout.seed={seed}",
           f"trainer.seed={seed + 1}", *overrides]
    row = harness.run_child(cmd, {"seed": seed, "numerics": numerics, "overrides": overrides}, out / "runs.jsonl",
                            harness.NUMERICS[numerics], ROOT, lambda res: {"gap_closed": gap_closed(res)})
    status = (f"{100 * row['accuracy'][0]:.1f}% -> {100 * row['accuracy'][-1]:.1f}% (teacher "
              f"{100 * row['teacher_accuracy']:.1f}%, gap closed {100 * row['gap_closed']:.1f}%)" if "accuracy" in row
              else f"FAILED rc={row['returncode']}")
    print(f"{numerics} seed {seed}: {status} ({row['wall_seconds']:.0f}s)", flush=True)
    return row


def summarize(rows: list[dict[str, Any]]) -> str:
    lines = ["| numerics | runs | failed | student start % | student end % | teacher % | gap closed % | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for g in sorted({r["numerics"] for r in rows}) + ["all"]:
        rs = [r for r in rows if g in ("all", r["numerics"])]
        ok = [r for r in rs if "accuracy" in r]
        mmm = harness.min_med_max
        lines.append(f"| {g} | {len(rs)} | {len(rs) - len(ok)} | {mmm([r['accuracy'][0] for r in ok], 100)} | "
                     f"{mmm([r['accuracy'][-1] for r in ok], 100)} | {mmm([r['teacher_accuracy'] for r in ok], 100)} | "
                     f"{mmm([r['gap_closed'] for r in ok], 100)} | {mmm([r['wall_seconds'] for r in ok])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_sweep_args(parser, seeds="0-4", out="runs/distill_seeds")
    args = parser.parse_intermixed_args()
    if args.child:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(distill(Path(args.child), *args.overrides)))
        return
    out, rows = harness.sweep(args, lambda out, seed, num: launch(out, seed, num, args.overrides))
    harness.write_table(out / "summary.md", summarize(rows), append=False)


if __name__ == "__main__":
    main()
