"""Micro-benchmark of hybridflow.protocol.DataProto (a script, not a test).

Times slice/chunk/split/select (expected O(1) in data size: views) against select_idxs/concat/repeat/save+load
(copies, O(data); with plain-torch baselines to show DataProto's overhead) on DataProtos with eight [rows, 2048] float32 tensors plus a `uid` string column, at a small and
a large row count; the ratio column shows which operations scale with the data.

Run: .venv/bin/python benchmarks/protocol.py [--rows 512 4096] [--cols 2048] [--tensors 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch

from hybridflow.protocol import DataProto


def bench(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds per call over `repeats` rounds after one warm-up; fast calls loop to fill ~20 ms a round."""
    t0 = time.perf_counter()
    fn()
    number = max(1, int(0.02 / max(time.perf_counter() - t0, 1e-7)))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
    return float(np.median(times))


def build(rows: int, cols: int, tensors: int) -> DataProto:
    batch = {f"t{i}": torch.randn(rows, cols) for i in range(tensors)}
    return DataProto.from_dict(batch, {"uid": [f"uid-{i}" for i in range(rows)]}, {"temperature": 1.0})


def operations(data: DataProto, tmp: str) -> dict[str, Callable[[], object]]:
    n = len(data)
    half_keys = list(data.batch)[: len(data.batch) // 2]
    perm = torch.randperm(n)
    parts = data.chunk(8)

    def save_load() -> DataProto:
        data.save(tmp)
        return DataProto.load(tmp)

    return {
        "slice data[1:n-1] (view)": lambda: data[1 : n - 1],
        "chunk(8) (views)": lambda: data.chunk(8),
        "split(n/8) (views)": lambda: data.split(n // 8),
        "select(half the keys)": lambda: data.select(batch_keys=half_keys),
        "unpad(1) (view)": lambda: data.unpad(1),
        "select_idxs(perm) (gather copy)": lambda: data.select_idxs(perm),
        "  baseline: index_select per key": lambda: [t.index_select(0, perm) for t in data.batch.values()],
        "concat(8 chunks) (copy)": lambda: DataProto.concat(parts),
        "  baseline: torch.cat per key": lambda: [torch.cat([c.batch[k] for c in parts]) for k in data.batch],
        "repeat(2, interleave) (copy)": lambda: data.repeat(2),
        "save+load (safetensors+JSON)": save_load,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, nargs=2, default=[512, 4096], metavar=("SMALL", "LARGE"))
    p.add_argument("--cols", type=int, default=2048)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = torch default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    small, large = args.rows
    results: dict[int, dict[str, float]] = {}
    for rows in (small, large):
        data = build(rows, args.cols, args.tensors)
        mib = sum(t.numel() * t.element_size() for t in data.batch.values()) / 2**20
        print(f"# {data!r}  ({mib:.0f} MiB of tensors)")
        with tempfile.TemporaryDirectory() as tmp:
            results[rows] = {name: bench(fn, args.repeats) for name, fn in operations(data, tmp).items()}
        del data
    print(f"\n| operation | {small} rows | {large} rows | ratio ({large // small}x data) |")
    print("|---|---:|---:|---:|")
    for name in results[small]:
        a, b = results[small][name], results[large][name]
        print(f"| {name} | {fmt(a)} | {fmt(b)} | {b / a:.1f}x |")


def fmt(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-3 else f"{seconds * 1e3:.1f} ms"


if __name__ == "__main__":
    main()
