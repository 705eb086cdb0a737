"""What the benchmark scripts share: the environment stamp, atomic JSON files, median summaries, markdown cells, the
workload flags and the seed sweeps' child runs. A script keeps only what it measures; its flags, file names and keys
stay its own. torch is imported only where needed, so a parent that leaves the GPU to its children stays light."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ environment stamp
def commit() -> str:
    """BENCH_COMMIT when set (the device copy of the tree has no .git, or one that lags the tree), else the short
    HEAD of this checkout; "" when neither is known."""
    sha = os.environ.get("BENCH_COMMIT", "")
    if sha:
        return sha
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                             check=False)
    except OSError:
        return ""
    return git.stdout.strip()


def gpu_name(cuda_context: bool = True) -> str:
    """The GPU's name, or the CPU's. `cuda_context=False` asks nvidia-smi instead of torch.cuda, so this process
    creates no CUDA context (a parent whose child processes need all the memory)."""
    if not cuda_context:
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, check=False, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return "cpu"
        lines = smi.stdout.strip().splitlines()
        return lines[0] if smi.returncode == 0 and lines else "cpu"
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"


def utc_now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def environment(cuda_context: bool = True) -> dict[str, str]:
    """Date (UTC), commit, GPU, torch and Python: the line above every results table."""
    import torch  # importing torch creates no CUDA context; only torch.cuda calls would

    return {"date": utc_now(), "commit": commit() or "unknown",
            "gpu": gpu_name(cuda_context), "torch": torch.__version__, "python": platform.python_version()}


# ------------------------------------------------------------------------------------------------ output files
def write_json(path: Path | str, obj: Any, indent: int | None = 1) -> None:
    """`obj` as JSON through a temporary file and a rename: a reader, or a kill mid-write, never sees half a file.
    Scripts call it after every step or case, so a later OOM or timeout keeps what was measured before it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=indent, default=str))
    tmp.replace(path)


def emit_json_line(result: dict[str, Any], out: str | None) -> None:
    """Print `result` as one JSON line (the last line of the output, which the rounds parse); also into `out`."""
    line = json.dumps(result)
    print(line)
    if out:
        Path(out).write_text(line + "\n")


def write_table(path: Path, table: str, append: bool = True) -> None:
    """Print a markdown table and write it to `path`; appended by default, so variants run into one directory keep
    one table each."""
    with open(path, "a" if append else "w") as fh:
        fh.write(table + ("\n\n" if append else "\n"))
    print(table)


# --------------------------------------------------------------------------------------------------- summaries
def summarize(steps: list[dict[str, float]]) -> dict[str, float]:
    """The median of every metric over the steps that report it."""
    keys = sorted({k for m in steps for k in m})
    return {k: float(statistics.median([m[k] for m in steps if k in m])) for k in keys}


def median_or_none(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def min_med_max(values: list[float], scale: float = 1.0, fmt: str = ".1f") -> str:
    """`min / median / max` of `scale * values`, or a dash when there are none."""
    if not values:
        return "–"
    v = [scale * x for x in values]
    return f"{min(v):{fmt}} / {statistics.median(v):{fmt}} / {max(v):{fmt}}"


def cell(value: Any, fmt: str = "{:.3f}") -> str:
    """A markdown table cell: `fmt` applied, or "-" for a value not measured."""
    return "-" if value is None else fmt.format(value)


# ------------------------------------------------------------------------------------------------------- flags
def add_workload_args(ap: argparse.ArgumentParser, response_len: int = 256) -> None:
    """--device, --prompts, --n, --prompt-len, --response-len: the GRPO workload of the GPU rounds
    (32 prompts × 8 samples, 256 + 256 tokens on CUDA unless told)."""
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=response_len)


def add_override_arg(ap: argparse.ArgumentParser, help: str) -> None:
    ap.add_argument("--override", action="append", default=[], help=help)


def apply_smoke(args: argparse.Namespace, smoke: dict[str, Any]) -> None:
    """With --smoke, replace the flags a script's smoke mode fixes (CPU, tiny shapes)."""
    if args.smoke:
        for key, value in smoke.items():
            setattr(args, key, value)


# ------------------------------------------------------------------------------------------------- seed sweeps
# CPU numerics a sweep can pin: the same seed gives other floats under another ISA, so a result that holds under both
# is not an accident of one machine's kernels.
NUMERICS: dict[str, dict[str, str]] = {
    "default": {},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}


def add_sweep_args(ap: argparse.ArgumentParser, seeds: str, out: str) -> None:
    """--seeds, --numerics, --jobs, --out, the hidden --child and the positional overrides of a seed sweep."""
    ap.add_argument("--seeds", default=seeds)
    ap.add_argument("--numerics", default="default,avx2")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (one core each)")
    ap.add_argument("--out", default=out)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", metavar="a.b=c")


def parse_choices(text: str, valid: Any, flag: str) -> list[str]:
    """A comma-separated flag's values, each one of `valid` (else exit naming the flag, the values and the choices)."""
    given = text.split(",")
    unknown = [x for x in given if x not in valid]
    if unknown:
        raise SystemExit(f"{flag} {','.join(unknown)}: choose from {', '.join(valid)}")
    return given


def parse_seeds(text: str) -> list[int]:
    """`0-4` (inclusive range) or `0,3,7`."""
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def sweep(args: argparse.Namespace, launch: Callable[[Path, int, str], dict[str, Any]]) -> tuple[Path, list[dict]]:
    """Run `launch(out, seed, numerics)` for every seed x numerics of `add_sweep_args`' flags, `--jobs` at a time;
    (the resolved output folder, the rows in job order)."""
    numerics = parse_choices(args.numerics, NUMERICS, "--numerics")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(s, n) for n in numerics for s in parse_seeds(args.seeds)]
    with ThreadPoolExecutor(args.jobs) as pool:
        return out, list(pool.map(lambda j: launch(out, j[0], j[1]), jobs))


def run_child(cmd: list[str], row: dict[str, Any], jsonl: Path, env: dict[str, str] | None = None,
              cwd: Path | None = None, derive: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
              ) -> dict[str, Any]:
    """One run of a sweep in its own process (one OpenMP thread, unbuffered). `row` gains the wall time, the return
    code and the child's last stdout line as JSON (plus `derive` of it), or `error`, the stderr tail; the row is
    appended to `jsonl` at once, so a sweep stopped midway keeps the runs it finished."""
    full_env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, cwd=cwd)
    row |= {"wall_seconds": time.perf_counter() - start, "returncode": proc.returncode}
    if proc.returncode == 0:
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        row |= res | (derive(res) if derive else {})
    else:
        row["error"] = proc.stderr[-3000:]
    with jsonl.open("a") as f:
        f.write(json.dumps(row) + "\n")
    return row
