"""`hybridflow report RUN_DIR [--out report.html] [--png DIR]`: HTML report with plots from a run directory."""

from __future__ import annotations

import argparse

from hybridflow.commands.common import fail


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (trainer.run_dir), holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="HTML file to write (default RUN_DIR/report.html)")
    parser.add_argument("--png", default=None, metavar="DIR", help="also write each figure as DIR/<name>.png")


def run(args: argparse.Namespace) -> int:
    from hybridflow.tracking.report import render_report

    try:
        path = render_report(args.run_dir, out=args.out, png_dir=args.png)
    except ValueError as err:
        return fail(err)
    print(f"report written to {path}")
    if args.png:
        print(f"figures written to {args.png}/")
    return 0
