"""`hybridflow dpo [CONFIG.yaml ...] [a.b=c ...]`: offline preference optimisation (DPO / cDPO / IPO / SimPO,
`dpo.loss_type`) on prompt/chosen/rejected data, then an HF export of the policy and the closing summary.

`hybridflow dpo --online ...` (= `dpo.online=true`): online DPO — prompts as for `hybridflow train`, `rollout.n`
responses each, ranked by `reward.*`, the DPO loss on each prompt's best/worst pair; checkpoints like `train`
(`hybridflow export` turns one into an HF directory)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridflow.commands.common import add_config_args, fail, load_from_args
from hybridflow.commands.tracked import TrackedRun, add_run_flags, next_command
from hybridflow.commands.train import rl_next_commands
from hybridflow.config import Config
from hybridflow.preflight import check_before_run
from hybridflow.tracking import Tracker


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser)
    add_run_flags(parser)
    parser.add_argument("--online", action="store_true",
                        help="online DPO (same as dpo.online=true): sample pairs with the rollout engine, rank them "
                             "with reward.*")


def run(args: argparse.Namespace) -> int:
    items = [*args.args, "dpo.online=true"] if args.online else args.args
    try:
        cfg = load_from_args(items, command="dpo", runs=True)
        if not cfg.dpo.online:
            from hybridflow.trainer.dpo import dpo_model_config

            check_before_run(dpo_model_config(cfg), command="dpo")  # model, pair files' columns, before anything loads
    except (ValueError, KeyError) as err:
        return fail(err)
    if cfg.dpo.online:
        return _run_online(cfg, args, items)
    from hybridflow.trainer.dpo import DPOTrainer
    from hybridflow.trainer.supervised import run_supervised

    def train(tracker: Tracker) -> Path:
        return run_supervised(DPOTrainer, cfg, tracker=tracker)[0]

    def next_commands(export: Path | None, ckpt: Path | None) -> list[str]:
        return [next_command("eval", items, model__path=export, trainer__run_dir=None,
                             trainer__default_local_dir=None)] if export is not None else []

    return TrackedRun(cfg, args, "dpo", loss_name(cfg), next_commands).run(train)


def loss_name(cfg: Config) -> str:
    """DPO | cDPO (label smoothing) | IPO | SimPO."""
    if cfg.dpo.loss_type == "dpo":
        return "cDPO" if cfg.dpo.label_smoothing > 0 else "DPO"
    return {"ipo": "IPO", "simpo": "SimPO"}.get(cfg.dpo.loss_type, cfg.dpo.loss_type)


def _run_online(cfg: Config, args: argparse.Namespace, items: list[str]) -> int:
    from hybridflow.trainer.dpo import dpo_model_config
    from hybridflow.trainer.online_dpo import run_online_dpo

    try:
        check_before_run(dpo_model_config(cfg), command="dpo")  # model, prompt files and reward functions, before anything loads
    except (ValueError, KeyError) as err:
        return fail(err)

    def train(tracker: Tracker) -> None:
        run_online_dpo(cfg, tracker=tracker)

    return TrackedRun(cfg, args, "online_dpo", f"online {loss_name(cfg)}",
                      lambda export, ckpt: rl_next_commands(cfg, items, ckpt)).run(train)
