"""Runs a benchmark script as a user does (`python -m benchmarks.X` from the repository root, one intra-op thread)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--prompts", "4", "--n", "2", "--prompt-len", "16", "--response-len", "8", "--steps", "1"]


def run_module(module: str, *args: str, timeout: int, env: dict | None = None) -> subprocess.CompletedProcess:
    full = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"} | (env or {})
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
