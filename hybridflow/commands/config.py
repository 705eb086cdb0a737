"""`hybridflow config show|validate [FILE ...] [a.b=c ...]`.

`show` prints the resolved YAML (`--diff`: only the keys that differ from the defaults); `validate` also checks what
the config points at for one command (`--for train|sft|rm|dpo`; by default the commands whose sections the files
and overrides set) — model, data files and their columns, the reward function's file and signature, the sandbox,
fsspec backends — without loading a model, and prints each command's step plan.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from hybridflow.commands.common import add_config_args, load_from_args, split_args
from hybridflow.config import Config, ConfigError, load_config, to_dict, to_yaml
from hybridflow.config.loader import read_yaml
from hybridflow.config.plan import COMMANDS, step_plan
from hybridflow.preflight import train_rows

# Sections only `hybridflow train` (and online DPO) reads; verl's roots count as train sections too.
_TRAIN_SECTIONS = ("actor", "rollout", "critic", "ref", "reward", "algorithm", "actor_rollout_ref", "reward_model",
                   "custom_reward_function")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("show", "validate"),
                        help="show: print the resolved YAML; validate: check it and what it points at")
    parser.add_argument("--diff", action="store_true", help="show: only the keys that differ from the defaults")
    parser.add_argument("--for", dest="for_command", choices=COMMANDS, default=None,
                        help="validate: check what this command uses (default: from the sections set: sft, rm, dpo, "
                             "else train)")
    add_config_args(parser)


def diff_from_defaults(config: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The nested subset of `config` whose leaves (lists count as leaves) differ from `defaults`."""
    out = {}
    for key, value in config.items():
        base = defaults.get(key)
        if isinstance(value, dict) and isinstance(base, dict):
            sub = diff_from_defaults(value, base)
            if sub:
                out[key] = sub
        elif key not in defaults or value != base:
            out[key] = value
    return out


def sections_set(items: list[str]) -> set[str]:
    """Top-level sections named by the YAML files and overrides of a command line."""
    files, overrides = split_args(items)
    found = {key.split(".", 1)[0].lstrip("+") for key in (o.split("=", 1)[0] for o in overrides)}
    for f in files:
        found |= set(read_yaml(Path(f)))
    return found


def infer_commands(items: list[str]) -> list[str]:
    """The commands a config is for: each of sft/rm/dpo whose section is set, and train when a train-only section
    is set or none of them is."""
    found = sections_set(items)
    out = [c for c in ("sft", "rm", "dpo") if c in found]
    if not out or found & set(_TRAIN_SECTIONS):
        out.insert(0, "train")
    return out


def validate(items: list[str], command: str) -> str:
    """Check the config for `command`; the step plan line (ConfigError listing every problem otherwise)."""

    cfg: Config = load_from_args(items, preflight=True, command=command)
    rows = train_rows(cfg)
    if rows is None:
        return "no step plan: data.train_files has remote files, whose rows are counted when the run reads them"
    try:
        return step_plan(cfg, rows, command)[2]
    except ValueError as err:
        raise ConfigError(str(err)) from None


def run(args: argparse.Namespace) -> int:
    if args.action == "validate":
        for command in [args.for_command] if args.for_command else infer_commands(args.args):
            print(f"config is valid for `hybridflow {command}`: {validate(args.args, command)}")
        return 0
    cfg = load_from_args(args.args)
    if not args.diff:
        print(to_yaml(cfg), end="")
        return 0
    changed = diff_from_defaults(to_dict(cfg), to_dict(load_config(validate=False)))
    print(yaml.safe_dump(changed, sort_keys=False, default_flow_style=False, width=110) if changed
          else "# same as the defaults\n", end="")
    return 0
