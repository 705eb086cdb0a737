"""`hybridflow rm [CONFIG.yaml ...] [a.b=c ...]`: Bradley-Terry reward-model training, then an HF export and the
closing summary (preference accuracy before → after, the export, the command that trains with it)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridflow.commands.common import add_config_args, fail, load_from_args
from hybridflow.commands.tracked import TrackedRun, add_run_flags, next_command, sibling
from hybridflow.config import Config
from hybridflow.tracking import Tracker

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
    from hybridflow.trainer.supervised import run_supervised

    try:
        cfg = load_from_args(args.args, preflight=True, command="rm", runs=True)
    except (ValueError, KeyError) as err:
        return fail(err)

    def train(tracker: Tracker) -> Path:
        path, history = run_supervised(RMTrainer, cfg, tracker=tracker)
        if not history:
            command.notes.append(f"already at the last step, nothing trained; the model in {path} is unchanged")
        return path

    command = TrackedRun(cfg, args, "rm", "reward model",
                         lambda export, ckpt: rm_next_commands(cfg, args.args, export))
    return command.run(train)
