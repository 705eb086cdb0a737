"""The vision-language task (`colour_count`, examples/colour_count.yaml) by stage over seeds × CPU numerics: the
numbers behind the bounds of tests/e2e/test_vl_learning.py (docs/benchmarks.md, "Vision-language learning").

    python -m benchmarks.colour_count_seeds --stage sft --seeds 0-4 --numerics default,avx2 --jobs 1 [k=v ...]
    python -m benchmarks.colour_count_seeds --stage rl --seeds 0-4 --numerics default,avx2 --jobs 1 [k=v ...]

`sft`: the stage-1 test's SFT of `tiny-vl` from scratch (`SFT_OVERRIDES`), every seed shifted by `s` (model.seed=s,
data.seed=s+1, trainer.seed=s+1): final val/loss. `rl`: the stage-2 test's GRPO from the committed warm start
`tests/assets/sft_colour_count` (`RL_OVERRIDES`), the RL seeds shifted by `s` (rollout.seed=s, trainer.seed=s+1;
the data split stays the checkpoint's): validation success rate (sampled at temperature 1) before and after,
and the gain. Each run in its
own process with one intra-op thread; `avx2` emulates an AVX2-only CPU (`benchmarks/harness.NUMERICS`). Output:
`<out>/runs.jsonl` (a line per run, appended as runs finish) and a min / median / max table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "colour_count.yaml"
CHECKPOINT = ROOT / "tests" / "assets" / "sft_colour_count"
SFT_OVERRIDES = ("sft.extra_schedules=0", "trainer.test_freq=50")  # as make_sft_checkpoint.py validates
RL_OVERRIDES = ("trainer.test_freq=20",)  # validated before and after only (the example validates every 5 steps)


def _cfg(run_dir: Path, *overrides: str) -> Any:
    from hybridflow.config import load_config

    return load_config([EXAMPLE], [f"trainer.run_dir={run_dir}", f"trainer.default_local_dir={run_dir}/ckpt",
                                   "trainer.logger=[jsonl]", *overrides])


def sft_run(run_dir: Path, *overrides: str) -> dict[str, Any]:
    """The example's SFT from scratch as the stage-1 test runs it: (step, val/loss) at each validation."""
    from hybridflow.tracking import Tracker
    from hybridflow.trainer.sft import run_sft

    cfg = _cfg(run_dir, *SFT_OVERRIDES, *overrides)
    start = time.perf_counter()
    with Tracker.from_config(cfg) as tracker:
        run_sft(cfg, out_dir=run_dir / "hf", tracker=tracker)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [(int(r["training/global_step"]), round(r["val/loss"], 4)) for r in rows if "val/loss" in r]
    return {"val_losses": val, "val_loss": val[-1][1], "seconds": time.perf_counter() - start}


def rl_config(run_dir: Path, *overrides: str) -> Any:
    """The example's RL phase from the committed warm start, as the stage-2 test runs it."""
    return _cfg(run_dir, f"model.path={CHECKPOINT}", *RL_OVERRIDES, *overrides)


def rl_run(run_dir: Path, *overrides: str) -> dict[str, Any]:
    """The example's GRPO from the committed warm start: validation success rate at step 0 and each validation."""
    from hybridflow.trainer.run import run_ppo

    start = time.perf_counter()
    history = run_ppo(rl_config(run_dir, *overrides))
    acc = [m["val/accuracy"] for m in history if "val/accuracy" in m]
    return {"accuracy": acc, "start": acc[0], "end": acc[-1], "gain": acc[-1] - acc[0],
            "seconds": time.perf_counter() - start}


def launch(out: Path, stage: str, seed: int, numerics: str, overrides: list[str]) -> dict[str, Any]:
    seeds = ([f"model.seed={seed}", f"data.seed={seed + 1}"] if stage == "sft" else [f"rollout.seed={seed}"])
    cmd = [sys.executable, "-m", "benchmarks.colour_count_seeds", "--stage", stage, "--child",
           str(out / f"{stage}_{numerics}_s{seed}"), *seeds, f"trainer.seed={seed + 1}", *overrides]
    row = harness.run_child(cmd, {"stage": stage, "seed": seed, "numerics": numerics, "overrides": overrides},
                            out / "runs.jsonl", harness.NUMERICS[numerics], ROOT)
    status = ("FAILED" if row["returncode"] else f"val/loss {row['val_loss']:.4f}" if stage == "sft"
              else f"{100 * row['start']:.1f}% -> {100 * row['end']:.1f}%")
    print(f"{stage} {numerics} seed {seed}: {status} ({row['wall_seconds']:.0f}s)", flush=True)
    return row


def summarize(rows: list[dict[str, Any]], stage: str) -> str:
    """min / median / max per numerics and over all runs: SFT val/loss, or RL start / end / gain (points)."""
    cols = ["val/loss"] if stage == "sft" else ["start %", "end %", "gain (points)"]
    lines = [f"| numerics | runs | failed | {' | '.join(cols)} | wall s |", "| --- " * (len(cols) + 4) + "|"]
    for g in sorted({r["numerics"] for r in rows}) + ["all"]:
        rs = [r for r in rows if g in ("all", r["numerics"])]
        ok = [r for r in rs if not r["returncode"]]
        cells = ([harness.min_med_max([r["val_loss"] for r in ok], 1, ".4f")] if stage == "sft" else
                 [harness.min_med_max([r[k] for r in ok], 100) for k in ("start", "end", "gain")])
        lines.append(f"| {g} | {len(rs)} | {len(rs) - len(ok)} | {' | '.join(cells)} | "
                     f"{harness.min_med_max([r['wall_seconds'] for r in ok], 1, '.0f')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_sweep_args(parser, seeds="0-4", out="runs/colour_count_seeds")
    parser.add_argument("--stage", choices=("sft", "rl"), required=True)
    args = parser.parse_intermixed_args()
    if args.child:
        import torch

        torch.set_num_threads(1)
        run = sft_run if args.stage == "sft" else rl_run
        print(json.dumps(run(Path(args.child), *args.overrides)))
        return
    out, rows = harness.sweep(args, lambda out, seed, num: launch(out, args.stage, seed, num, args.overrides))
    harness.write_table(out / f"summary_{args.stage}.md", summarize(rows, args.stage), append=False)


if __name__ == "__main__":
    main()
