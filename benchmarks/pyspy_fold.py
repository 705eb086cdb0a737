"""Fold `py-spy record --format raw --threads [--subprocesses]` output into a short per-thread table: each thread's
samples, its busiest frames inclusive (a frame counted once per sample) and its leaf frames (where the CPU was).

Usage: python3 benchmarks/pyspy_fold.py RAW [--top 25] [--min-share 0.02] [--focus FRAME] > summary.txt
`--focus`: only samples whose stack holds a frame containing FRAME, cut to start there (where that function's time
goes); with `py-spy record --idle` a thread's waits count too (its wall time, not only its CPU time).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def frame_name(frame: str) -> str:
    m = FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    file = m["file"].rsplit("/", 2)
    return f"{m['fn']} ({'/'.join(file[-2:])})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--min-share", type=float, default=0.02, help="threads under this share of samples are listed only")
    ap.add_argument("--focus", default="", help="keep samples under the first frame containing this, cut there")
    args = ap.parse_args()
    total: Counter[str] = Counter()
    incl: dict[str, Counter[str]] = defaultdict(Counter)
    leaf: dict[str, Counter[str]] = defaultdict(Counter)
    with open(args.raw) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            parts = stack.split(";")
            k = 0  # the leading process / thread entries (a subprocess adds its own under its parent's)
            while k < len(parts) and parts[k].startswith(("process ", "thread ")):
                k += 1
            roots, rest = parts[:k], parts[k:]
            key = " | ".join(r[:90] for r in roots)
            if args.focus:
                at = next((i for i, p in enumerate(rest) if args.focus in p), None)
                if at is None:
                    continue
                rest = rest[at:]
            frames = [frame_name(p) for p in rest]
            total[key] += n
            for name in set(frames):
                incl[key][name] += n
            if frames:
                leaf[key][frames[-1]] += n
    grand = sum(total.values())
    print(f"samples: {grand}")
    for key, n in total.most_common():
        if n < args.min_share * grand:
            print(f"(small) {n:8d}  {key}")
            continue
        print(f"\n=== {n} samples ({100 * n / grand:.1f}%)  {key}")
        print("  inclusive:")
        for name, c in incl[key].most_common(args.top):
            print(f"    {100 * c / n:5.1f}%  {name}")
        print("  leaf:")
        for name, c in leaf[key].most_common(args.top // 2):
            print(f"    {100 * c / n:5.1f}%  {name}")


if __name__ == "__main__":
    main()
