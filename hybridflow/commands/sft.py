"""`hybridflow sft [CONFIG.yaml ...] [a.b=c ...]`: supervised fine-tuning, then an HF export of the model."""

from __future__ import annotations

import argparse

from hybridflow.commands.common import add_config_args, fail, load_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser)


def run(args: argparse.Namespace) -> int:
    from hybridflow.trainer.sft import SFTTrainer
    from hybridflow.trainer.supervised import run_supervised

    try:
        cfg = load_from_args(args.args, preflight=True, command="sft", runs=True)
        path, history = run_supervised(SFTTrainer, cfg)
    except (ValueError, KeyError) as err:
        return fail(err)
    if not history:
        print(f"SFT: already at the last step, nothing trained; the model in {path} is unchanged")
        return 0
    last = history[-1]
    val = ", ".join(f"{k}={v:.4f}" for k, v in last.items() if k.startswith("val/"))
    print(f"SFT done: {len(history)} logged steps{', ' + val if val else ''}; HF model in {path}")
    print(f"use it with: hybridflow train model.path={path}")
    return 0
