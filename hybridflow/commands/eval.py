"""`hybridflow eval [CONFIG.yaml ...] [a.b=c ...]`: validation accuracy/reward of `model.path` (or a preset) on
`data.val_files` or the built-in task's validation split, with `rollout.val_kwargs` (greedy by default).

It prints the closing summary (what the accuracy counts, the decoding) and, with `--verbose`, every metric. Nothing
is written: the trainer it builds for validation gets a temporary checkpoint directory, removed afterwards."""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

from hybridflow.commands.common import add_config_args, fail, load_from_args
from hybridflow.commands.tracked import add_run_flags, print_lines, verbose
from hybridflow.config import Config, to_dict
from hybridflow.tracking.summary import Outcome, build_summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser)
    add_run_flags(parser)


def evaluate(cfg: Config) -> dict[str, float]:
    """The validator's metrics for `cfg`'s model; no checkpoint directory is left behind."""
    from hybridflow.trainer.ppo import PPOTrainer

    with tempfile.TemporaryDirectory(prefix="hybridflow-eval-") as scratch:
        cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, default_local_dir=scratch,
                                                                   resume_mode="disable"))
        trainer = PPOTrainer(cfg)
        try:
            if trainer.validator is None:
                raise ValueError("no validation data: set data.val_files=[...] or use a built-in data.task")
            return trainer.validator.run(step=0)
        finally:
            trainer.close()


def run(args: argparse.Namespace) -> int:
    cfg = load_from_args(args.args, preflight=True, runs=True)
    start = time.monotonic()
    try:
        metrics = evaluate(cfg)
    except ValueError as err:
        return fail(err)
    if verbose(args):
        _print_table(cfg, metrics)
    outcome = Outcome(method="eval", seconds=time.monotonic() - start,
                      title=f"evaluation of {cfg.model.path or cfg.model.preset}")
    print_lines(build_summary(outcome, [{"step": 0, **metrics}], to_dict(cfg)))
    return 0


def _print_table(cfg: Config, metrics: dict[str, float]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"evaluation of {cfg.model.path or cfg.model.preset}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in sorted(metrics.items()):
        table.add_row(key, f"{value:.4f}")
    Console().print(table)
