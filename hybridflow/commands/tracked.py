"""A training command's run as the user sees it: the tracker (console style from `--verbose`), one line saying where
the resolved config was written, then the closing summary — whether the run finished, was interrupted or failed.

The command owns its tracker (the trainers accept one) so the summary can be printed after `run_end` is recorded,
from the run's own metrics.jsonl: a resumed run's summary starts at the first attempt's step 0.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hybridflow.commands.common import fail, load_from_args, split_args
from hybridflow.config import Config, to_dict, to_yaml
from hybridflow.tracking import Tracker
from hybridflow.tracking.jsonl import read_metrics
from hybridflow.tracking.run_info import CONFIG_FILE
from hybridflow.tracking.summary import Outcome, build_summary
from hybridflow.tracking.tracker import run_status
from hybridflow.trainer.stop import exit_code

if TYPE_CHECKING:
    from hybridflow.trainer.supervised import SupervisedTrainer

logger = logging.getLogger(__name__)


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """`--verbose` and `--quiet-config`, accepted by every command that runs a model."""
    parser.add_argument("--verbose", dest="show_all", action="store_true",
                        help="print every metric as a table each logged step, and the resolved config")
    parser.add_argument("--quiet-config", action="store_true",
                        help="do not say where the resolved config was written")


def verbose(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "show_all", False))


def announce_config(cfg: Config, args: argparse.Namespace, run_dir: Path | None = None) -> None:
    """One line naming the resolved config file (the whole YAML with `--verbose`); nothing with `--quiet-config`."""
    if verbose(args):
        print(to_yaml(cfg), end="", flush=True)
    if getattr(args, "quiet_config", False):
        return
    where = Path(run_dir or cfg.trainer.run_dir) / CONFIG_FILE
    print(f"resolved config: {where}", flush=True)


def next_command(command: str, items: Sequence[str], **replace: object) -> str:
    """`hybridflow <command>` with the user's config files and overrides, `replace` (dotted key → value) winning;
    a value of None drops the key."""
    files, overrides = split_args(list(items))
    keys = {k.replace("__", ".") for k in replace}
    kept = [o for o in overrides if o.split("=", 1)[0] not in keys]
    added = [f"{k.replace('__', '.')}={v}" for k, v in replace.items() if v is not None]
    return " ".join(["hybridflow", *command.split(), *(shlex.quote(str(a)) for a in [*files, *kept, *added])])


def sibling(path: str | Path, suffix: str) -> Path:
    """`runs/x/default` → `runs/x/default_<suffix>`: a directory of its own for the next run."""
    p = Path(path)
    return p.with_name(f"{p.name}_{suffix}")


def latest_checkpoint(cfg: Config) -> Path | None:
    from hybridflow.checkpoint import atomic

    root = cfg.trainer.default_local_dir
    if "://" in root:
        return None
    return atomic.find_latest_of_run(Path(root))


@dataclass
class TrackedRun:
    """One training command's run; `run` returns the exit code after printing the closing summary."""

    cfg: Config
    args: argparse.Namespace
    method: str  # ppo | sft | rm | dpo | online_dpo
    title: str | None = None
    # (exported HF directory or None, latest checkpoint or None) → the next commands to suggest
    next_commands: Callable[[Path | None, Path | None], list[str]] = field(default=lambda export, ckpt: [])
    notes: list[str] = field(default_factory=list)  # the train function may add lines for the summary

    def run(self, train: Callable[[Tracker], Path | None]) -> int:
        from hybridflow.trainer.run_dir import claimed_run_dirs

        start = time.monotonic()
        with contextlib.ExitStack() as claim:
            try:  # the run's directories: a lock, and no fresh run into another run's metrics (trainer/run_dir.py)
                claim.enter_context(claimed_run_dirs(self.cfg))
            except ValueError as err:
                return fail(err)
            tracker = Tracker.from_config(self.cfg, console={"verbose": verbose(self.args)})
            announce_config(self.cfg, self.args)
            export: Path | None = None
            error: BaseException | None = None
            try:
                with tracker:
                    export = train(tracker)
            except BaseException as err:  # noqa: BLE001 - summarised, then re-raised or turned into an exit code below
                error = err
            try:
                self.print_summary(tracker, export, error, time.monotonic() - start)
            except Exception as summary_error:  # the run's own outcome (and error) must reach the user regardless
                logger.exception("the closing summary could not be printed: %s", summary_error)
                if error is None:
                    raise
        if error is None:
            return 0
        if isinstance(error, KeyboardInterrupt):
            return exit_code(error)  # 130 for Ctrl-C, 143 for SIGTERM
        if isinstance(error, (ValueError, KeyError)):
            return fail(error)
        raise error

    def print_summary(self, tracker: Tracker, export: Path | None, error: BaseException | None,
                      seconds: float) -> None:
        status = run_status(error)
        ckpt = latest_checkpoint(self.cfg)
        outcome = Outcome(
            method=self.method, status=status, seconds=seconds, total_steps=tracker.total_steps,
            error=error_line(error),
            checkpoint=ckpt, resumable=self.cfg.trainer.resume_mode != "disable", export=export,
            run_dir=tracker.run_dir, next_commands=tuple(self.next_commands(export, ckpt)), title=self.title,
            notes=tuple(self.notes))
        rows = read_metrics(tracker.run_dir)
        print_lines(build_summary(outcome, rows, to_dict(self.cfg)))


def run_supervised_command(args: argparse.Namespace, trainer_cls: type[SupervisedTrainer], method: str, title: str,
                           next_commands: Callable[[Config, list[str], Path | None], list[str]]) -> int:
    """`hybridflow sft|rm`: the config checked before anything loads, `trainer_cls` trained from its last checkpoint,
    the summary with `next_commands(cfg, command line, export)`; a finished run re-run trains nothing and says so."""
    from hybridflow.trainer.supervised import run_supervised

    try:
        cfg = load_from_args(args.args, preflight=True, command=method, runs=True)
    except (ValueError, KeyError) as err:
        return fail(err)

    def train(tracker: Tracker) -> Path:
        path, history = run_supervised(trainer_cls, cfg, tracker=tracker)
        if not history:
            command.notes.append(f"already at the last step, nothing trained; the model in {path} is unchanged")
        return path

    command = TrackedRun(cfg, args, method, title, lambda export, ckpt: next_commands(cfg, args.args, export))
    return command.run(train)


def error_line(error: BaseException | None) -> str | None:
    """`Type: first line` of an unexpected failure; None for a usage error (`error: ...` follows it)."""
    if error is None or isinstance(error, (ValueError, KeyError)):
        return None
    text = str(error).splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def print_lines(lines: Sequence[str]) -> None:
    """The summary under a rule, on stdout (where the step lines went)."""
    sys.stdout.flush()
    print("─" * 20 + " summary " + "─" * 20)
    for line in lines:
        print(line)
    sys.stdout.flush()
