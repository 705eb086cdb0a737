"""The quickstart's learning over seeds × CPU numerics: the numbers behind the README's range.

    python -m benchmarks.quickstart_seeds --seeds 0-7 --numerics default,avx2 --jobs 2 --out runs/qs_seeds [k=v ...]

Each run is `hybridflow quickstart` (SFT warm start, then GRPO) in its own process with one intra-op thread and every
seed shifted by `s` (model.seed=s, data.seed=s+1, rollout.seed=s, trainer.seed=s+1, so s=0 is the shipped
default). `avx2` emulates an AVX2-only CPU on this one (`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
MKL_ENABLE_INSTRUCTIONS=AVX2`): other kernels, other float rounding, the way another machine would run.
Per run: SFT steps and final val/loss, validation accuracy before RL and after each validation, the gain, times.
Output: `<out>/runs.jsonl` (one line per run, appended as runs finish) and a min / median / max table.

`--sft-only`: the SFT warm start alone, run as tests/e2e/test_learning_stages.py's stage-1 test runs it (`run_sft`
with the run's overrides, e.g. `sft.total_steps=400 sft.extra_schedules=0 trainer.test_freq=50`); the table is the
final val/loss — the numbers behind that test's bound.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import min_med_max


def seed_overrides(seed: int, fixed_model: bool = False) -> list[str]:
    """Every seed shifted by `seed`; from a fixed model only the RL seeds (sampling, trainer) move: the data seed
    also draws the train/validation split, which must stay the one the model was fine-tuned on."""
    rl = [f"rollout.seed={seed}", f"trainer.seed={seed + 1}"]
    return rl if fixed_model else [f"model.seed={seed}", f"data.seed={seed + 1}", *rl]


def sft_only_run(run_dir: Path, overrides: list[str]) -> dict[str, Any]:
    """The quickstart's SFT warm start alone, as the stage-1 test runs it; returns its val/loss trajectory."""
    import torch

    from hybridflow.commands.quickstart import QUICKSTART_YAML
    from hybridflow.config import load_config
    from hybridflow.tracking import Tracker
    from hybridflow.trainer.sft import run_sft

    torch.set_num_threads(1)
    cfg = load_config([QUICKSTART_YAML], [f"trainer.run_dir={run_dir}", f"trainer.default_local_dir={run_dir}/ckpt",
                                          "trainer.logger=[jsonl]", *overrides])
    start = time.perf_counter()
    with Tracker.from_config(cfg) as tracker:
        run_sft(cfg, out_dir=run_dir / "hf", tracker=tracker)
    sft = [m for m in _read_jsonl(run_dir / "metrics.jsonl") if "val/loss" in m]
    return {"sft_steps": int(sft[-1]["training/global_step"]), "sft_val_loss": sft[-1]["val/loss"],
            "sft_val_losses": [(int(m["training/global_step"]), round(m["val/loss"], 4)) for m in sft],
            "sft_seconds": time.perf_counter() - start}


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def one_run(run_dir: Path, overrides: list[str], sft_from: Path | None = None,
            model: Path | None = None) -> dict[str, Any]:
    """The quickstart in this process; returns the learning summary (called by the child processes).
    `sft_from`: a run dir of an earlier sweep whose `sft_model` the GRPO phase starts from (SFT is skipped);
    `model`: an HF directory the RL phase starts from (SFT is skipped)."""
    import torch

    from hybridflow.commands.quickstart import QUICKSTART_YAML, run_quickstart
    from hybridflow.config import load_config

    torch.set_num_threads(1)
    cfg = load_config([QUICKSTART_YAML], [f"trainer.run_dir={run_dir}", f"trainer.default_local_dir={run_dir}/ckpt",
                                          "trainer.logger=[jsonl]", *overrides])
    result = run_quickstart(cfg, sft_dir=model or (None if sft_from is None else sft_from / "sft_model"))
    sft = [m for m in _read_jsonl((sft_from or run_dir) / "sft" / "metrics.jsonl") if "val/loss" in m]
    acc = [a for _, a, _ in result.val_accuracy()]
    return {**_async_summary(result.history), "sft_steps": int(sft[-1]["training/global_step"]) if sft else None,
            "sft_val_loss": sft[-1]["val/loss"] if sft else None,
            "sft_val_losses": [(int(m["training/global_step"]), round(m["val/loss"], 4)) for m in sft],
            "val_accuracy": acc, "start": acc[0], "end": acc[-1], "gain": acc[-1] - acc[0],
            "sft_seconds": result.sft_seconds, "total_seconds": result.total_seconds}


# non-sync modes: how old the trained samples were and (partial_rollout=continue) how many rows spanned a weight swap;
# any mode: how far the updates moved off the sampling policy (0 on a strictly on-policy step, whatever the loss);
# MoE models: how often the trainer's routers chose the rollout's experts, and the log-prob gap between the two
_ASYNC_MEANS = ("async/mixed_version_rows", "staleness/mean", "staleness/token_mean", "staleness/max",
                "actor/pg_clipfrac", "actor/ppo_kl", "moe/routing_agreement", "moe/logprob_gap")


def _async_summary(history: list[dict[str, float]]) -> dict[str, Any]:
    """Means over the training steps of the staleness metrics (absent in sync mode), of the clip fraction and KL to
    the sampling policy and of the MoE metrics (absent where n/a), the largest staleness and the weight swaps inside
    generate calls (summed)."""
    out: dict[str, Any] = {}
    for key in _ASYNC_MEANS:
        vals = [m[key] for m in history if key in m]
        if vals:
            out[key] = statistics.fmean(vals)
    if any("staleness/max" in m for m in history):
        out["staleness/max_max"] = max(m["staleness/max"] for m in history if "staleness/max" in m)
    swaps = [m["rollout/weight_swaps"] for m in history if "rollout/weight_swaps" in m]
    if swaps:
        out["rollout/weight_swaps"] = sum(swaps)
    return out


def launch(out: Path, work: Path, seed: int, numerics: str, overrides: list[str],
           sft_from: Path | None = None, model: Path | None = None, sft_only: bool = False) -> dict[str, Any]:
    run_dir = work / f"{numerics}_s{seed}"
    cmd = [sys.executable, "-m", "benchmarks.quickstart_seeds", "--child", str(run_dir),
           *seed_overrides(seed, fixed_model=model is not None), *overrides,
           *([] if sft_from is None else ["--sft-from", str(sft_from / run_dir.name)]),
           *([] if model is None else ["--model", str(model)]), *(["--sft-only"] if sft_only else [])]
    row = harness.run_child(cmd, {"seed": seed, "numerics": numerics, "overrides": overrides}, out / "runs.jsonl",
                            harness.NUMERICS[numerics])
    status = (f"gain {100 * row['gain']:+.1f}" if "gain" in row else f"SFT val/loss {row['sft_val_loss']:.4f}"
              if "sft_val_loss" in row else f"FAILED rc={row['returncode']}")
    print(f"{numerics} seed {seed}: {status} ({row['wall_seconds']:.0f}s)", flush=True)
    return row


def summarize(rows: list[dict[str, Any]]) -> str:
    """min / median / max of start, end, gain (points), SFT steps and time, per numerics and over all runs."""
    lines = ["| numerics | runs | failed | start % | end % | gain (points) | SFT steps | total s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]

    mixed = [r["async/mixed_version_rows"] for r in rows if "async/mixed_version_rows" in r]
    if mixed:
        lines[0] += " mixed-version rows % |"
        lines[1] += " --- |"
    groups = sorted({r["numerics"] for r in rows}) + ["all"]
    for g in groups:
        rs = [r for r in rows if g in ("all", r["numerics"])]
        ok = [r for r in rs if "gain" in r]
        lines.append(f"| {g} | {len(rs)} | {len(rs) - len(ok)} | {min_med_max([r['start'] for r in ok], 100)} | "
                     f"{min_med_max([r['end'] for r in ok], 100)} | {min_med_max([r['gain'] for r in ok], 100)} | "
                     f"{min_med_max([r['sft_steps'] or 0 for r in ok], 1, '.0f')} | "
                     f"{min_med_max([r['total_seconds'] for r in ok], 1, '.0f')} |"
                     + (f" {min_med_max([r.get('async/mixed_version_rows', 0.0) for r in ok], 100)} |" if mixed else ""))
    return "\n".join(lines)


def summarize_sft(rows: list[dict[str, Any]]) -> str:
    """min / median / max of the SFT-only runs' final val/loss and time, per numerics and over all runs."""
    lines = ["| numerics | runs | failed | SFT steps | final val/loss min / median / max | SFT s |",
             "| --- | --- | --- | --- | --- | --- |"]
    for g in sorted({r["numerics"] for r in rows}) + ["all"]:
        rs = [r for r in rows if g in ("all", r["numerics"])]
        ok = [r for r in rs if "sft_val_loss" in r]
        loss, secs = [r["sft_val_loss"] for r in ok], [r["sft_seconds"] for r in ok]
        steps = sorted({r["sft_steps"] for r in ok})
        lines.append(f"| {g} | {len(rs)} | {len(rs) - len(ok)} | {'/'.join(map(str, steps)) or '–'} | "
                     + (f"{min(loss):.4f} / {statistics.median(loss):.4f} / {max(loss):.4f} | "
                        f"{min(secs):.0f}–{max(secs):.0f} |" if ok else "– | – |"))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_sweep_args(parser, seeds="0-7", out="runs/quickstart_seeds")
    parser.add_argument("--work", default=None, help="where the runs write (default: --out)")
    parser.add_argument("--sft-from", default=None, help="a sweep's work folder: start GRPO from its SFT models")
    parser.add_argument("--model", default=None, help="an HF directory every run's RL phase starts from (no SFT)")
    parser.add_argument("--sft-only", action="store_true", help="the SFT warm start alone (the stage-1 test's run)")
    args = parser.parse_intermixed_args()
    if args.child and args.sft_only:
        print(json.dumps(sft_only_run(Path(args.child), args.overrides)))
        return
    if args.child:
        print(json.dumps(one_run(Path(args.child), args.overrides, args.sft_from and Path(args.sft_from),
                                 args.model and Path(args.model).resolve())))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    numerics = harness.parse_choices(args.numerics, harness.NUMERICS, "--numerics")
    jobs = [(s, n) for n in numerics for s in harness.parse_seeds(args.seeds)]
    with ThreadPoolExecutor(args.jobs) as pool:
        work = Path(args.work) / out.name if args.work else out  # one folder per sweep: sweeps may run side by side
        sft_from = Path(args.sft_from) if args.sft_from else None
        model = Path(args.model).resolve() if args.model else None
        rows = list(pool.map(lambda j: launch(out, work, j[0], j[1], args.overrides, sft_from, model,
                                              args.sft_only), jobs))
    harness.write_table(out / "summary.md", summarize_sft(rows) if args.sft_only else summarize(rows), append=False)


if __name__ == "__main__":
    main()
