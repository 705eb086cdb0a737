"""`hybridflow eval [CONFIG.yaml ...] [a.b=c ...]`: validation accuracy/reward of `model.path` (or a preset) on
`data.val_files` or the built-in task's validation split, with `rollout.val_kwargs` (greedy by default)."""

from __future__ import annotations

import argparse

from hybridflow.commands.common import add_config_args, fail, load_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from hybridflow.trainer.ppo import PPOTrainer

    cfg = load_from_args(args.args, preflight=True, runs=True)
    trainer = PPOTrainer(cfg)
    try:
        if trainer.validator is None:
            return fail(ValueError("no validation data: set data.val_files=[...] or use a built-in data.task"))
        metrics = trainer.validator.run(step=0)
    finally:
        trainer.close()
    table = Table(title=f"evaluation of {cfg.model.path or cfg.model.preset}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in sorted(metrics.items()):
        table.add_row(key, f"{value:.4f}")
    Console().print(table)
    return 0
