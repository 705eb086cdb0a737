"""`hybridflow dpo [CONFIG.yaml ...] [a.b=c ...]`: offline preference optimisation (DPO / cDPO / IPO / SimPO,
`dpo.loss_type`) on prompt/chosen/rejected data, then an HF export of the policy.

`hybridflow dpo --online ...` (= `dpo.online=true`): online DPO — prompts as for `hybridflow train`, `rollout.n`
responses each, ranked by `reward.*`, the DPO loss on each prompt's best/worst pair; checkpoints like `train`
(`hybridflow export` turns one into an HF directory)."""

from __future__ import annotations

import argparse

from hybridflow.commands.common import add_config_args, fail, load_from_args
from hybridflow.config import Config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser)
    parser.add_argument("--online", action="store_true",
                        help="online DPO (same as dpo.online=true): sample pairs with the rollout engine, rank them "
                             "with reward.*")


def run(args: argparse.Namespace) -> int:
    items = [*args.args, "dpo.online=true"] if args.online else args.args
    try:
        cfg = load_from_args(items, command="dpo", runs=True)
        if cfg.dpo.online:
            return _run_online(cfg)
        from hybridflow.config.preflight import check_before_run
        from hybridflow.trainer.dpo import DPOTrainer, dpo_model_config

        check_before_run(dpo_model_config(cfg), command="dpo")  # model, pair files' columns, before anything loads
        from hybridflow.trainer.supervised import run_supervised

        path, history = run_supervised(DPOTrainer, cfg)
    except (ValueError, KeyError) as err:
        return fail(err)
    last = history[-1] if history else {}
    print(f"{cfg.dpo.loss_type} done: {len(history)} logged steps{_val(last)}; HF model in {path}")
    print(f"evaluate it with: hybridflow eval model.path={path}")
    return 0


def _run_online(cfg: Config) -> int:
    from hybridflow.config.preflight import check_before_run
    from hybridflow.trainer.dpo import dpo_model_config
    from hybridflow.trainer.online_dpo import run_online_dpo

    check_before_run(dpo_model_config(cfg), command="dpo")  # model, prompt files and reward functions, before anything loads
    history = run_online_dpo(cfg)
    last = history[-1] if history else {}
    ckpt = cfg.trainer.default_local_dir
    print(f"online {cfg.dpo.loss_type} done: {len(history)} logged steps{_val(last)}; checkpoints in {ckpt}")
    print(f"export the latest with: hybridflow export --checkpoint {ckpt} --out HF_DIR")
    return 0


def _val(last: dict[str, float]) -> str:
    val = ", ".join(f"{k}={v:.4f}" for k, v in last.items() if k.startswith("val/"))
    return f", {val}" if val else ""
