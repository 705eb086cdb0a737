"""The `hybridflow` command. Each subcommand lives in `hybridflow/commands/<name>.py` and registers itself here.

The CLI is the only place that prints for humans; library code logs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence

# Before anything loads torch (and its OpenMP runtime, which reads this once): threads waiting for work sleep
# instead of spinning, so a CPU run beside a busy process does not fight it for cores (hybridflow/utils/threads.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from hybridflow.commands.common import fail  # noqa: E402
from hybridflow.config import ConfigError  # noqa: E402
from hybridflow.trainer.stop import exit_code
from hybridflow.version import __version__  # noqa: E402

# name -> (module under hybridflow.commands, one-line help). Modules are imported only when their command runs,
# so `hybridflow --help` stays fast and a missing optional dependency breaks only its own command.
COMMANDS: dict[str, tuple[str, str]] = {
    "quickstart": ("quickstart", "SFT warm start + GRPO with a tiny model (CPU, minutes): arithmetic, or --config FILE"),
    "train": ("train", "PPO/GRPO training: hybridflow train [CONFIG.yaml ...] [a.b=c ...]"),
    "sft": ("sft", "supervised fine-tuning: hybridflow sft [CONFIG.yaml ...] [a.b=c ...]"),
    "rm": ("rm", "reward-model training on prompt/chosen/rejected data"),
    "dpo": ("dpo", "preference optimisation (DPO, cDPO, IPO, SimPO) on prompt/chosen/rejected data"),
    "generate": ("generate", "offline generation from a parquet of prompts to a parquet of outputs"),
    "eval": ("eval", "validation accuracy/reward of model.path (or a preset) with rollout.val_kwargs"),
    "export": ("export", "write a checkpoint as a Hugging Face model directory"),
    "data": ("data", "prepare datasets (gsm8k, math) into verl-schema parquet"),
    "report": ("report", "render an HTML report with plots from a run directory"),
    "config": ("config", "show or validate the resolved configuration"),
    "plan": ("plan", "predict GPU memory per stage and step time, and the settings that fit: plan CONFIG --gpus N"),
}


def _available_commands() -> dict[str, tuple[str, str]]:
    out = {}
    for name, (module, help_text) in COMMANDS.items():
        if importlib.util.find_spec(f"hybridflow.commands.{module}") is not None:
            out[name] = (module, help_text)
    return out


def _chosen_command(argv: Sequence[str]) -> str | None:
    """The command named on the line (the first word that is one), before any parsing."""
    return next((a for a in argv if a in COMMANDS), None)


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """Every command is listed; only the one named in `argv` is imported for its arguments (`hybridflow --help`
    imports no command module, hence no torch)."""
    parser = argparse.ArgumentParser(
        prog="hybridflow",
        description="RL post-training for LLMs (PPO, GRPO, SFT, RM, DPO) — single controller, hybrid engine.",
    )
    parser.add_argument("--version", action="version", version=f"hybridflow {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging (and, for a command that trains, every metric each step)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = _chosen_command(argv)
    for name, (module, help_text) in _available_commands().items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            mod = importlib.import_module(f"hybridflow.commands.{module}")
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:  # `cfg.yaml --quiet-config a=b`: argparse ends the positionals at the flag; the rest are config args
        if not hasattr(args, "args") or any(item.startswith("-") for item in extra):
            parser.parse_args(argv)  # the usual "unrecognized arguments" error
        args.args = [*args.args, *extra]
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    # the agent endpoint's clients (rollout.agent.mode=server) would log one INFO line per request
    logging.getLogger("httpx").setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    if args.verbose and hasattr(args, "show_all"):  # `hybridflow -v train` = `hybridflow train --verbose` + debug logs
        args.show_all = True
    if not getattr(args, "command", None):
        parser.print_help()
        return 0
    try:
        return int(args._run(args) or 0)
    except ConfigError as err:  # any command: a bad key or value is a usage error (exit 2), not a traceback
        return fail(err)
    except KeyboardInterrupt as err:  # Ctrl-C / SIGTERM: the user's own stop is one line, not a traceback

        print(f"stopped: {err}" if str(err) else "stopped (Ctrl-C)", file=sys.stderr)
        return exit_code(err)


if __name__ == "__main__":
    sys.exit(main())
