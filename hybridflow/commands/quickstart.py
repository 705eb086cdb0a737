"""`hybridflow quickstart [a.b=c ...]`: the embedded default main job, one process on CPU (or one GPU).

Builds the tiny model and the built-in arithmetic task, runs a short SFT warm start, then GRPO, and prints
validation accuracy before and after RL. Overrides apply on top of `hybridflow/config/quickstart.yaml`.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from hybridflow.commands.common import ConfigError, fail
from hybridflow.config import load_config

QUICKSTART_YAML = Path(__file__).resolve().parent.parent / "config" / "quickstart.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="key.path=value",
                        help="overrides on top of the quickstart config, e.g. trainer.total_training_steps=20")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from hybridflow.tracking import Tracker
    from hybridflow.trainer.run import run_ppo, versions_line
    from hybridflow.trainer.sft import run_sft

    console = Console()
    try:
        cfg = load_config([QUICKSTART_YAML], args.overrides)
    except ConfigError as err:
        return fail(err)
    console.rule("[bold]hybridflow quickstart")
    console.print(versions_line(), style="dim")
    console.print(f"task: {cfg.data.task} · model: {cfg.model.preset} {cfg.model.override_config} · "
                  f"run dir: {cfg.trainer.run_dir}")
    start = time.perf_counter()

    console.rule(f"1/2 SFT warm start ({cfg.sft.total_steps} steps)")
    run_dir = Path(cfg.trainer.run_dir)
    sft_cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, log_every=max(1, (cfg.sft.total_steps or 80) // 8)))
    sft_tracker = Tracker.from_config(sft_cfg, run_dir=run_dir / "sft")
    try:
        sft_dir = run_sft(sft_cfg, out_dir=run_dir / "sft_model", tracker=sft_tracker)
    finally:
        sft_tracker.close()
    sft_time = time.perf_counter() - start

    console.rule(f"2/2 GRPO ({cfg.trainer.total_training_steps} steps, {cfg.rollout.n} samples per prompt)")
    ppo_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(sft_dir)))
    tracker = Tracker.from_config(ppo_cfg)
    try:
        history = run_ppo(ppo_cfg, tracker=tracker)
    finally:
        tracker.close()
    total = time.perf_counter() - start

    vals = [(int(m["training/global_step"]), m) for m in history if "val/accuracy" in m]
    table = Table(title="validation accuracy (greedy, held-out problems)")
    table.add_column("stage")
    table.add_column("step", justify="right")
    table.add_column("accuracy", justify="right")
    table.add_column("reward", justify="right")
    for step, m in vals:
        stage = "after SFT (before RL)" if step == 0 else f"GRPO step {step}"
        table.add_row(stage, str(step), f"{100 * m['val/accuracy']:.1f}%", f"{m['val/reward']:.3f}")
    console.print(table)
    if len(vals) >= 2:
        gain = 100 * (vals[-1][1]["val/accuracy"] - vals[0][1]["val/accuracy"])
        console.print(f"accuracy {100 * vals[0][1]['val/accuracy']:.1f}% → {100 * vals[-1][1]['val/accuracy']:.1f}% "
                      f"({gain:+.1f} points) · SFT {sft_time:.0f}s · total {total:.0f}s")
    console.print(f"metrics: {cfg.trainer.run_dir}/metrics.jsonl · report: hybridflow report {cfg.trainer.run_dir}")
    return 0
