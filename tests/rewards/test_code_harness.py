"""The `code` reward's tests cannot be passed without running them: every way a program could end the run early,
fake the harness's output or steal its nonce scores 0, while ordinary programs still score 1."""

from __future__ import annotations

import pytest

from hybridflow import sandbox
from hybridflow.rewards import REWARD_FUNCTIONS

TESTS = {"test_code": "assert add(2, 3) == 5"}
WRONG = "def add(a, b):\n    return 0\n"

# Each would have scored 1.0 with the tests appended to the program (it ends the process with status 0 first).
ENDS_EARLY = {
    "os._exit": WRONG + "import os\nos._exit(0)\n",
    "sys.exit": WRONG + "import sys\nsys.exit(0)\n",
    "raise SystemExit": WRONG + "raise SystemExit\n",
    "atexit": WRONG + "import atexit, os\natexit.register(os._exit, 0)\n",
    "signal handler": WRONG + "import os, signal\nsignal.signal(signal.SIGUSR1, lambda *a: os._exit(0))\n"
                              "os.kill(os.getpid(), signal.SIGUSR1)\n",
    "excepthook": WRONG + "import os, sys\nsys.excepthook = lambda *a: os._exit(0)\n",
    "exit from the tested function": "import os\ndef add(a, b):\n    os._exit(0)\n",
}
# Each would forge a pass if the harness trusted stdout, its builtins, or could be read by the program.
_STEAL = ("    while f is not None:\n        v = f.f_locals.get('verdict')\n        if isinstance(v, bytes):\n"
          "            import os\n            os.write(1, v)\n            os._exit(0)\n        f = f.f_back\n"
          "    return 0\n")
FORGES = {
    "fake stdout": WRONG + "import sys\nclass Fake:\n    def write(self, s):\n        return len(s)\n"
                           "    def flush(self):\n        pass\nsys.stdout = Fake()\nprint = lambda *a, **k: None\n",
    "patched AssertionError": WRONG + "import builtins\nclass Never(Exception):\n    pass\n"
                                      "builtins.AssertionError = Never\nAssertionError = Never\n",
    "patched __import__": WRONG + "import builtins\nbuiltins.__import__ = lambda *a, **k: None\n",
    "self-kill": WRONG + "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "re-read stdin": WRONG + "import os\nos.lseek(0, 0, 0)\nnonce = os.read(0, 64).split(b'\\n')[0]\n"
                             "os.write(1, b'\\n' + nonce + b' passed\\n')\nos._exit(0)\n",
    "caller frames": "import sys\ndef add(a, b):\n    f = sys._getframe(1)\n" + _STEAL,
    "traceback frames": "def add(a, b):\n    try:\n        raise ValueError\n    except ValueError as e:\n"
                        "        f = e.__traceback__.tb_frame\n" + _STEAL,
    "trace function": "import sys\ndef add(a, b):\n    return 0\ndef tracer(frame, event, arg):\n    f = frame\n"
                      + _STEAL.replace("return 0", "return tracer") + "sys.settrace(tracer)\n",
    "gc": WRONG + "import gc\ngc.get_objects()\n",
    "ctypes": WRONG + "import ctypes\n",
    "fork": WRONG + "import os\nif os.fork():\n    os._exit(0)\n",
}


@pytest.fixture(autouse=True)
def isolated() -> None:
    if not any(sandbox.available(m) for m in sandbox.ISOLATED_MODES):
        pytest.skip("no sandbox mode works on this host (tests/rewards/test_sandbox.py covers the refusal)")


def _score(program: str, tests: dict | None = None) -> float:
    return REWARD_FUNCTIONS["code"]("code", f"```python\n{program}```", tests or TESTS, None)["score"]


@pytest.mark.parametrize("name", list(ENDS_EARLY))
def test_ending_the_run_early_scores_zero(name: str) -> None:
    assert _score(ENDS_EARLY[name]) == 0.0


@pytest.mark.parametrize("name", list(FORGES))
def test_forging_the_verdict_scores_zero(name: str) -> None:
    assert _score(FORGES[name]) == 0.0


def test_ordinary_programs_still_pass() -> None:
    program = ("import sys\nfrom collections import namedtuple\nfrom enum import Enum\nimport logging\n"
               "input = sys.stdin.readline\nP = namedtuple('P', 'x y')\nColor = Enum('Color', 'RED GREEN')\n"
               "logging.getLogger('x').warning('logged')\n"
               "def add(a, b):\n    print('adding', a, b)\n    return a + b\n"
               "if __name__ == '__main__':\n    print(P(1, 2), Color.RED, end='')\n")
    assert _score(program) == 1.0
    assert _score(program, {"test_code": "assert add(2, 3) == 6"}) == 0.0
    assert _score(program, {"test_code": "import sys\nassert add(1, 1) == 2\nsys.exit(0)"}) == 0.0  # SystemExit: no pass
    recursive = "import sys\nsys.setrecursionlimit(10000)\ndef depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\n"
    assert _score(recursive, {"test_code": "assert depth(3000) == 3000"}) == 1.0


@pytest.mark.parametrize("path", ["/proc/self/mem", "//proc/self/mem", "/tmp/../proc/self/mem",
                                  b"/proc/self/mem", "PATH_OBJECT"])
def test_proc_is_denied_however_the_path_is_spelled(path) -> None:
    from pathlib import Path

    from hybridflow.rewards.code_harness import _audit

    arg = Path("/proc/self/mem") if path == "PATH_OBJECT" else path
    with pytest.raises(PermissionError, match="/proc"):
        _audit("open", (arg, "r", 0))
    _audit("open", ("/tmp/procfile", "r", 0))  # a name that only starts like it is allowed
    _audit("open", (3, "r", 0))  # an fd


def test_proc_is_denied_for_a_relative_path_after_chdir(monkeypatch) -> None:
    from hybridflow.rewards.code_harness import _audit

    monkeypatch.chdir("/proc")
    with pytest.raises(PermissionError, match="/proc"):
        _audit("open", ("self/mem", "r", 0))
