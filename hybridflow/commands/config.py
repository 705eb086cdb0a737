"""`hybridflow config show|validate [FILE ...] [a.b=c ...]`."""

from __future__ import annotations

import argparse

from hybridflow.commands.common import add_config_args, load_from_args
from hybridflow.config import to_yaml


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("show", "validate"), help="show: print the resolved YAML; validate: check it")
    add_config_args(parser)


def run(args: argparse.Namespace) -> int:
    cfg = load_from_args(args.args)
    if args.action == "show":
        print(to_yaml(cfg), end="")
    else:
        print("config is valid")
    return 0
