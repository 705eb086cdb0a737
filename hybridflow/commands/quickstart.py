"""`hybridflow quickstart [--config FILE.yaml] [a.b=c ...]`: the embedded default main job, one process on CPU (or one GPU).

Builds the tiny model and the built-in arithmetic task, runs a short SFT warm start on demonstrations with a
systematic error (`sft.label_noise`), then GRPO with the true reward, and prints validation accuracy before and
after RL. Overrides apply on top of `hybridflow/config/quickstart.yaml`, or of `--config` (another SFT + GRPO
recipe, e.g. `examples/tool_calculator.yaml`: the calculator tool task, whose table adds the well-formed calls).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridflow.commands.tracked import add_run_flags, print_lines, verbose
from hybridflow.config import Config, load_config, to_dict, to_yaml
from hybridflow.tracking import Tracker
from hybridflow.tracking.jsonl import read_metrics
from hybridflow.tracking.summary import Outcome, build_summary
from hybridflow.trainer.run import run_ppo, versions_line

QUICKSTART_YAML = Path(__file__).resolve().parent.parent / "config" / "quickstart.yaml"
# What `sft.label_noise` does to each built-in task's demonstrations (the SFT phase's heading says it).
FLAWS = {"arithmetic": "answer one too high",
         "tool_calculator": "make no call, a malformed call or a call of the wrong expression"}
WELL_FORMED = "val/rule/well_formed"  # the tool task's share of well-formed calls (rewards/tool_task.py)


@dataclass
class QuickstartResult:
    sft_dir: Path
    history: list[dict[str, float]]  # GRPO metrics per step (step 0 = validation of the SFT model)
    sft_seconds: float
    total_seconds: float

    def val_accuracy(self) -> list[tuple[int, float, float]]:
        """(step, val/accuracy, val/reward) for every validation, in order."""
        return [(int(m["training/global_step"]), m["val/accuracy"], m.get("val/reward", math.nan))
                for m in self.history if "val/accuracy" in m]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="a config to run instead of the quickstart's, e.g. examples/tool_calculator.yaml")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value",
                        help="overrides on top of the quickstart config, e.g. trainer.total_training_steps=20")
    add_run_flags(parser)


def run_quickstart(cfg: Config, console: object | None = None, sft_dir: Path | None = None,
                   verbose: bool = False) -> QuickstartResult:
    """SFT warm start, then GRPO from it; both tracked under `trainer.run_dir` (`sft/` and the run itself).
    `sft_dir`: an existing warm start (HF directory) to run the GRPO phase from, skipping SFT. `verbose`: the
    console prints every metric each logged step."""
    from hybridflow.trainer.sft import run_sft

    start = time.perf_counter()
    run_dir = Path(cfg.trainer.run_dir)
    if console is not None:
        sft, stop = cfg.sft, ""
        if sft.target_val_loss is not None:
            stop = f", {'until' if sft.stop_at_target else 'then checks'} val loss ≤ {sft.target_val_loss}"
        flaw = FLAWS.get(cfg.data.task or "", "are flawed")
        console.rule(f"1/2 SFT warm start ({'at most ' if sft.stop_at_target else ''}{sft.total_steps} steps{stop}; "
                     f"{100 * cfg.sft.label_noise:.0f}% of the demonstrations {flaw})")
    log_every = max(1, (cfg.sft.total_steps or 80) // 8)
    # `trainer.test_freq` is the GRPO phase's (every 5 steps): on the SFT steps that was a third of the SFT time.
    # Validate when the log prints, or every 50 steps to stop near sft.target_val_loss (one costs ~2 train steps).
    val_every = min(log_every, 50) if cfg.sft.stop_at_target and cfg.sft.target_val_loss else log_every
    sft_cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, log_every=log_every,
                                                                   test_freq=val_every))
    if sft_dir is None:
        with Tracker.from_config(sft_cfg, run_dir=run_dir / "sft", console={"verbose": verbose}) as sft_tracker:  # run_end: the phase's status
            sft_dir = run_sft(sft_cfg, out_dir=run_dir / "sft_model", tracker=sft_tracker)
    sft_seconds = time.perf_counter() - start
    if console is not None:
        console.rule(f"2/2 GRPO ({cfg.trainer.total_training_steps} steps, {cfg.rollout.n} samples per prompt, "
                     "reward = the true answer)")
    ppo_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(sft_dir)))
    with Tracker.from_config(ppo_cfg, console={"verbose": verbose}) as tracker:
        history = run_ppo(ppo_cfg, tracker=tracker)
    return QuickstartResult(Path(sft_dir), history, sft_seconds, time.perf_counter() - start)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    if "OMP_NUM_THREADS" not in os.environ:
        # A 0.8M-parameter model's kernels are too small to gain much from a second thread, and 2 intra-op threads
        # ran ~10x slower than 1 whenever anything else was running on our 2-core machine.
        torch.set_num_threads(1)
    console = Console()
    if args.config is not None and not Path(args.config).is_file():
        console.print(f"error: --config {args.config}: no such file")
        return 2
    cfg = load_config([Path(args.config) if args.config else QUICKSTART_YAML], args.overrides)
    console.rule("[bold]hybridflow quickstart")
    console.print(versions_line(), style="dim")
    console.print(f"task: {cfg.data.task} · model: {cfg.model.preset} {cfg.model.override_config} · "
                  f"run dir: {cfg.trainer.run_dir}")
    if verbose(args):
        console.print(to_yaml(cfg), end="", markup=False, highlight=False)
    if not args.quiet_config:
        console.print(f"resolved config: {cfg.trainer.run_dir}/config.yaml (the SFT phase's: sft/config.yaml)")
    result = run_quickstart(cfg, console, verbose=verbose(args))
    vals = result.val_accuracy()
    v = cfg.rollout.val_kwargs
    decoding = f"sampled at temperature {v.temperature:g}" if v.do_sample else "greedy decoding"
    well_formed = {int(m["training/global_step"]): m[WELL_FORMED] for m in result.history if WELL_FORMED in m}
    table = Table(title=f"validation accuracy ({decoding}, held-out problems)")
    columns = [("stage", "left"), ("step", "right"), ("accuracy", "right"), ("reward", "right")]
    for col, justify in columns + ([("well-formed calls", "right")] if well_formed else []):
        table.add_column(col, justify=justify)
    for step, acc, reward in vals:
        stage = "after SFT (before RL)" if step == 0 else f"GRPO step {step}"
        extra = [f"{100 * well_formed[step]:.1f}%" if step in well_formed else "-"] if well_formed else []
        table.add_row(stage, str(step), f"{100 * acc:.1f}%", f"{reward:.3f}", *extra)
    console.print(table)
    outcome = Outcome(method="ppo", title="quickstart (SFT warm start + GRPO)", seconds=result.total_seconds,
                      total_steps=cfg.trainer.total_training_steps, run_dir=Path(cfg.trainer.run_dir),
                      notes=(f"SFT warm start: {result.sft_seconds:.0f}s, model in {result.sft_dir} "
                             f"(metrics: {cfg.trainer.run_dir}/sft)",))
    print_lines(build_summary(outcome, read_metrics(cfg.trainer.run_dir), to_dict(cfg)))
    return 0
