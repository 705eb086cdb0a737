"""Shared CLI helpers: split positional args into YAML files and `a.b=c` overrides, load the config."""

from __future__ import annotations

import argparse
import sys

from hybridflow.config import Config, ConfigError, load_config
from hybridflow.preflight import check_before_run
from hybridflow.utils.threads import apply_cpu_threads


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("args", nargs="*", metavar="CONFIG.yaml | key.path=value",
                        help="YAML config files (applied in order) then dotted overrides, e.g. trainer.nnodes=2")


def split_args(items: list[str]) -> tuple[list[str], list[str]]:
    files = [a for a in items if "=" not in a]
    overrides = [a for a in items if "=" in a]
    return files, overrides


def load_from_args(items: list[str], validate: bool = True, *, preflight: bool = False, command: str = "train",
                   data: bool = True, reward: bool | None = None, runs: bool = False) -> Config:
    """The config of the command line; `preflight` also checks what `command` (train|sft|rm|dpo) uses of what it
    points at (model, data files and columns when `data`, reward functions when `reward`, default: the command
    scores responses) before anything loads — see `hybridflow.preflight`. `runs`: the command runs a model,
    so it gets its CPU thread count (`trainer.cpu_threads`, printed on stderr)."""
    files, overrides = split_args(items)
    cfg = load_config(files, overrides, validate=validate, command=command)
    if preflight:
        check_before_run(cfg, command=command, data=data, reward=reward)
    if runs:
        print(apply_cpu_threads(cfg.trainer.cpu_threads, cfg.trainer.device), file=sys.stderr)
    return cfg


def fail(err: Exception) -> int:
    print(f"error: {err}", file=sys.stderr)
    return 2


__all__ = ["ConfigError", "add_config_args", "fail", "load_from_args", "split_args"]
