"""`hybridflow rm [CONFIG.yaml ...] [a.b=c ...]`: Bradley-Terry reward-model training, then an HF export and the
closing summary (preference accuracy before → after, the export, the command that trains with it)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridflow.commands.common import add_config_args
from hybridflow.commands.tracked import add_run_flags, next_command, run_supervised_command, sibling
from hybridflow.config import Config

SOURCES = "[{name: model, weight: 0.7}, {name: rule, weight: 0.3}]"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser)
    add_run_flags(parser)


def rm_next_commands(cfg: Config, items: list[str], export: Path | None) -> list[str]:
    """RL with the reward model beside the rule reward, in run and checkpoint directories of its own."""
    if export is None:
        return []
    t = cfg.trainer
    return [next_command("train", items, reward__reward_model__path=export, reward__sources=SOURCES,
                         trainer__run_dir=sibling(t.run_dir, "rl"),
                         trainer__default_local_dir=sibling(t.default_local_dir, "rl"))]


def run(args: argparse.Namespace) -> int:
    from hybridflow.trainer.rm import RMTrainer

    return run_supervised_command(args, RMTrainer, "rm", "reward model", rm_next_commands)
