"""The sandbox stops infinite loops and memory bombs, blocks the network, and the `code` scorer uses it."""

from __future__ import annotations

import json
import time
from pathlib import Path

from hybridflow.rewards import REWARD_FUNCTIONS
from hybridflow.rewards.sandbox import run_python


def test_runs_code_with_stdin_in_a_temp_dir():
    r = run_python("import os\nprint(input()[::-1]); print(os.listdir('.'))", stdin="abc")
    assert r.ok and r.stdout.splitlines()[0] == "cba" and "main.py" in r.stdout


def test_infinite_loop_is_killed_at_the_timeout():
    start = time.monotonic()
    r = run_python("while True:\n    pass", timeout_s=1.0)
    assert r.timed_out and not r.ok and r.returncode is None
    assert time.monotonic() - start < 5


def _running(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status  # a zombie is dead, just not yet reaped


def test_sleeping_child_processes_die_with_the_group():
    r = run_python("import subprocess, sys, time\n"
                   "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                   "print(p.pid, flush=True)\ntime.sleep(60)", timeout_s=1.0)
    assert r.timed_out and r.duration_s < 5
    grandchild = int(r.stdout.split()[0])
    deadline = time.monotonic() + 5
    while _running(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(grandchild)


def test_memory_bomb_is_stopped():
    r = run_python("a = []\nwhile True:\n    a.append(bytearray(10**7))", timeout_s=10.0, memory_mb=256)
    assert not r.ok and not r.timed_out and "MemoryError" in r.stderr


def test_output_flood_is_bounded():
    r = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", timeout_s=5.0, max_output_mb=1)
    assert not r.ok and len(r.stdout) <= 1024 * 1024


def test_no_network():
    r = run_python("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\ns.settimeout(1)\n"
                   "s.connect(('1.1.1.1', 80))\nprint('connected')", timeout_s=5.0)
    assert not r.ok and "connected" not in r.stdout


def test_code_scorer_io_tests_and_test_code():
    code = REWARD_FUNCTIONS["code"]
    solution = "Here:\n```python\nn = int(input())\nprint(n * 2)\n```"
    gt = {"inputs": ["1\n", "5\n", "7\n"], "outputs": ["2\n", "10", "15"]}
    out = code("code", solution, json.dumps(gt), None)
    assert out["score"] == 2 / 3 and out["passed"] == 2 and out["total"] == 3
    func = "```python\ndef add(a, b):\n    return a + b\n```"
    assert code("code", func, {"test_code": "assert add(2, 3) == 5"}, None)["score"] == 1.0
    assert code("code", func, {"test_code": "assert add(2, 3) == 6"}, None)["score"] == 0.0
    assert code("code", "no code block", {"test_code": "pass"}, None)["score"] == 0.0
    loop = "```python\nwhile True: pass\n```"
    assert code("code", loop, {"test_code": "pass"}, {"timeout_s": 0.5})["score"] == 0.0
