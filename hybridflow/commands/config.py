"""`hybridflow config show|validate [FILE ...] [a.b=c ...]`.

`show` prints the resolved YAML (`--diff`: only the keys that differ from the defaults); `validate` also checks what
the config points at — model, data files, the reward function's file and signature — without loading a model.
"""

from __future__ import annotations

import argparse
from typing import Any

import yaml

from hybridflow.commands.common import add_config_args, load_from_args
from hybridflow.config import load_config, to_dict, to_yaml


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("show", "validate"),
                        help="show: print the resolved YAML; validate: check it and what it points at")
    parser.add_argument("--diff", action="store_true", help="show: only the keys that differ from the defaults")
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


def run(args: argparse.Namespace) -> int:
    if args.action == "validate":
        load_from_args(args.args, preflight=True)
        print("config is valid")
        return 0
    cfg = load_from_args(args.args)
    if not args.diff:
        print(to_yaml(cfg), end="")
        return 0
    changed = diff_from_defaults(to_dict(cfg), to_dict(load_config(validate=False)))
    print(yaml.safe_dump(changed, sort_keys=False, default_flow_style=False, width=110) if changed
          else "# same as the defaults\n", end="")
    return 0
