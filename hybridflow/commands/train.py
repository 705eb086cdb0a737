"""`hybridflow train [CONFIG.yaml ...] [a.b=c ...]`: print the resolved config and versions, then train."""

from __future__ import annotations

import argparse
import logging

from hybridflow.commands.common import add_config_args, fail, load_from_args
from hybridflow.config import to_yaml

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser)
    parser.add_argument("--quiet-config", action="store_true", help="do not print the resolved config")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from hybridflow.trainer.run import run_ppo, versions_line

    console = Console()
    cfg = load_from_args(args.args, preflight=True, runs=True)
    if cfg.dpo.online:
        return fail(ValueError("dpo.online=true is online DPO, run by `hybridflow dpo` (same config); `hybridflow "
                               "train` runs PPO/GRPO: drop dpo.online or use hybridflow dpo"))
    console.print(versions_line(), style="dim")
    if not args.quiet_config:
        console.print(to_yaml(cfg), end="", markup=False, highlight=False)
    try:
        run_ppo(cfg)
    except (ValueError, KeyError) as err:
        return fail(err)
    return 0
