"""`hybridflow data prepare gsm8k|math|arithmetic|sort|colour_count --input FILE [...] --out DIR`: write verl parquet.

gsm8k/math read local files (one parquet per input, named by its split: `train.parquet`, `test.parquet`);
arithmetic/sort/colour_count (its images as PNG bytes) write the built-in tasks (`train.parquet`, `val.parquet`)
with `--train-size/--val-size/--seed`.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from hybridflow.data.parquet_io import write_rows
from hybridflow.data.preprocess import PREPARERS, prepare, read_records, split_name
from hybridflow.data.tasks import TASKS, task_splits

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = sub.add_parser("prepare", help="write verl-schema parquet from local files or a built-in task")
    p.add_argument("dataset", choices=sorted([*PREPARERS, *TASKS]))
    p.add_argument("--input", nargs="+", default=[], help="local .jsonl/.json/.parquet files (gsm8k, math)")
    p.add_argument("--split", default=None, help="split name for a single --input (default: from the file name)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--train-size", type=int, default=4096, help="built-in tasks: training rows")
    p.add_argument("--val-size", type=int, default=256, help="built-in tasks: validation rows")
    p.add_argument("--seed", type=int, default=1, help="built-in tasks: generation seed")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.dataset in TASKS:
        train, val = task_splits(args.dataset, args.train_size, args.val_size, args.seed)
        for name, rows in (("train", train), ("val", val)):
            print(f"wrote {len(rows)} rows to {write_rows(rows, out / f'{name}.parquet')}")
        return 0
    if not args.input:
        print(f"error: {args.dataset} needs --input FILE [FILE ...] (local jsonl/json/parquet; nothing is downloaded)")
        return 2
    if args.split and len(args.input) > 1:
        print("error: --split names one input; give one --input per call, or name the files by split")
        return 2
    try:
        for path in args.input:
            split = args.split or split_name(path)
            rows = prepare(args.dataset, read_records(path), split)
            print(f"wrote {len(rows)} rows to {write_rows(rows, out / f'{split}.parquet')}")
    except ValueError as err:
        print(f"error: {err}")
        return 2
    return 0
