"""`hybridflow dpo [CONFIG.yaml ...] [a.b=c ...]`: offline preference optimisation (DPO / cDPO / IPO / SimPO,
`dpo.loss_type`) on prompt/chosen/rejected data, then an HF export of the policy."""

from __future__ import annotations

import argparse

from hybridflow.commands.common import add_config_args, fail, load_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser)


def run(args: argparse.Namespace) -> int:
    from hybridflow.trainer.dpo import DPOTrainer
    from hybridflow.trainer.supervised import run_supervised

    try:
        cfg = load_from_args(args.args, runs=True)
        path, history = run_supervised(DPOTrainer, cfg)
    except (ValueError, KeyError) as err:
        return fail(err)
    last = history[-1] if history else {}
    val = ", ".join(f"{k}={v:.4f}" for k, v in last.items() if k.startswith("val/"))
    print(f"{cfg.dpo.loss_type} done: {len(history)} logged steps{', ' + val if val else ''}; HF model in {path}")
    print(f"evaluate it with: hybridflow eval model.path={path}")
    return 0
