"""`hybridflow train [CONFIG.yaml ...] [a.b=c ...]`: PPO/GRPO training, one line per step, then the closing summary
(validation accuracy before → after, the checkpoint, the commands that export and evaluate it)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from hybridflow.commands.common import add_config_args, fail, load_from_args
from hybridflow.commands.tracked import TrackedRun, add_run_flags, next_command, sibling
from hybridflow.config import Config
from hybridflow.tracking import Tracker
from hybridflow.trainer.run import run_ppo


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser)
    add_run_flags(parser)


def rl_next_commands(cfg: Config, items: list[str], ckpt: Path | None) -> list[str]:
    """Export the latest checkpoint, then evaluate the export on the same task (the user's config)."""
    if ckpt is None:
        return []
    out = sibling(cfg.trainer.run_dir, "hf")
    return [f"hybridflow export --checkpoint {shlex.quote(str(ckpt.parent))} --out {shlex.quote(str(out))}",
            next_command("eval", items, model__path=out, dpo__online=None, trainer__run_dir=None,
                         trainer__default_local_dir=None)]


def run(args: argparse.Namespace) -> int:
    cfg = load_from_args(args.args, preflight=True, runs=True)
    if cfg.dpo.online:
        return fail(ValueError("dpo.online=true is online DPO, run by `hybridflow dpo` (same config); `hybridflow "
                               "train` runs PPO/GRPO: drop dpo.online or use hybridflow dpo"))
    est = cfg.algorithm.adv_estimator
    title = {"gae": "PPO", "grpo": "GRPO", "rloo": "RLOO", "remax": "ReMax"}.get(est, f"RL ({est})") + " training"

    def train(tracker: Tracker) -> None:
        run_ppo(cfg, tracker=tracker)

    return TrackedRun(cfg, args, "ppo", title,
                      lambda export, ckpt: rl_next_commands(cfg, args.args, ckpt)).run(train)
