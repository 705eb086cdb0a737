"""`hybridflow sft [CONFIG.yaml ...] [a.b=c ...]`: supervised fine-tuning, then an HF export of the model and the
closing summary (validation loss before → after, the export, the commands that evaluate it and train from it)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridflow.commands.common import add_config_args
from hybridflow.commands.tracked import add_run_flags, next_command, run_supervised_command, sibling
from hybridflow.config import Config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser)
    add_run_flags(parser)


def warm_start_next_commands(cfg: Config, items: list[str], export: Path | None) -> list[str]:
    """Evaluate the export on the task, then RL from it — with run and checkpoint directories of its own (an RL
    run refuses to resume this run's checkpoints, and would mix its metrics into this run's)."""
    if export is None:
        return []
    t = cfg.trainer
    return [next_command("eval", items, model__path=export, trainer__run_dir=None, trainer__default_local_dir=None),
            next_command("train", items, model__path=export, trainer__run_dir=sibling(t.run_dir, "rl"),
                         trainer__default_local_dir=sibling(t.default_local_dir, "rl"))]


def run(args: argparse.Namespace) -> int:
    from hybridflow.trainer.sft import SFTTrainer

    return run_supervised_command(args, SFTTrainer, "sft", "SFT", warm_start_next_commands)
