"""Run untrusted code (e.g. a model's program) in a subprocess with time, memory and output limits.

Limits: wall-clock timeout (the whole process group is SIGKILLed), RLIMIT_CPU, RLIMIT_AS (memory), RLIMIT_FSIZE
(stdout/stderr go to files in a fresh temp directory, its working directory), RLIMIT_CORE=0, and no network:
a new user + network namespace (`unshare`) when the kernel allows it, else the `socket` module is disabled in the
child (weaker; reported in `SandboxResult.network_isolated`). The child dies with its parent (PR_SET_PDEATHSIG),
so killing a reward worker never leaves programs behind; nothing the child does can raise in the caller.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_CLONE_NEWUSER, _CLONE_NEWNET, _PR_SET_PDEATHSIG = 0x10000000, 0x40000000, 1
# Prepended when no network namespace is available: makes socket creation fail in the child.
_NO_SOCKET_PRELUDE = (
    "import socket as _s\n"
    "def _blocked(*a, **k):\n    raise OSError('network disabled in the hybridflow sandbox')\n"
    "_s.socket = _s.create_connection = _s.socketpair = _blocked\ndel _s, _blocked\n"
)


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None  # None when killed for the timeout
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    network_isolated: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def _can_unshare_net() -> bool:
    """Probe once (in a throwaway child) whether unprivileged user+net namespaces work here."""
    flags = _CLONE_NEWUSER | _CLONE_NEWNET
    probe = f"import ctypes, sys; sys.exit(ctypes.CDLL(None).unshare({flags}) != 0)"
    try:
        return subprocess.run([sys.executable, "-c", probe], timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _limits(memory_mb: int, cpu_s: int, file_mb: int, isolate_net: bool) -> None:
    """preexec_fn: runs in the child between fork and exec (single-threaded)."""
    libc = _libc()
    if libc is not None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if isolate_net and libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
            raise OSError("unshare(CLONE_NEWNET) failed; refusing to run without network isolation")
    mem = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb * 1024 * 1024,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_python(code: str, stdin: str = "", timeout_s: float = 5.0, memory_mb: int = 512,
               max_output_mb: int = 8, python: str = sys.executable) -> SandboxResult:
    """Run `code` with `python -I` in a temp directory under the limits above."""
    isolate = _can_unshare_net()
    source = code if isolate else _NO_SOCKET_PRELUDE + code
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hybridflow-sandbox-") as tmp:
        work = Path(tmp)
        (work / "main.py").write_text(source)
        (work / "stdin.txt").write_text(stdin)
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "PYTHONHASHSEED": "0",
               "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
        with open(work / "stdin.txt", "rb") as fin, open(work / "out", "wb") as fout, open(work / "err", "wb") as ferr:
            proc = subprocess.Popen(
                [python, "-I", "main.py"], cwd=tmp, env=env, stdin=fin, stdout=fout, stderr=ferr,
                start_new_session=True, close_fds=True,
                preexec_fn=lambda: _limits(memory_mb, int(timeout_s) + 1, max_output_mb, isolate),
            )
            timed_out = False
            try:
                returncode: int | None = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out, returncode = True, None
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # exited between the timeout and the kill
                proc.wait()
        limit = max_output_mb * 1024 * 1024
        stdout = (work / "out").read_bytes()[:limit].decode("utf-8", "replace")
        stderr = (work / "err").read_bytes()[:limit].decode("utf-8", "replace")
    return SandboxResult(returncode, stdout, stderr, timed_out, time.monotonic() - start, isolate)
