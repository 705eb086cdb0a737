"""Run untrusted Python (a policy's program) in a sandbox; `run_python` is the one entry point.

Guarantees in the isolated modes (`bubblewrap`, preferred, else `namespaces`: the same layout built by our own
launcher with unshare + pivot_root): the program sees only read-only binds of /usr, the Python install (its
site-/dist-packages dirs covered by empty tmpfs: the standard library only), the dynamic-linker cache and a few
/dev nodes, and writes only to a private size-limited tmpfs (its cwd); it has no network (empty network
namespace); it is pid 1's tree in its own pid namespace, so at the time limit, or when the sandbox or its caller
dies, every process inside dies, `setsid` escapes included; rlimits cap memory (RLIMIT_AS), CPU, file size and
processes (RLIMIT_NPROC counts the sandbox's own processes only: a root caller's program runs as uid 65534 in a user
namespace of its own, as a non-root caller's does in its); a root caller's program has no capabilities.
When neither mode works, code rewards are refused unless `reward.sandbox.allow_unisolated=true` (mode `none`:
rlimits and a temp dir only; a root caller's program runs as uid 65534 there too, since RLIMIT_NPROC never binds
uid 0, and the mode is refused when that uid cannot run Python). Per-call limits may only lower the configured caps.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hybridflow.config.loader import build, load_defaults_dict
from hybridflow.config.schema import SandboxConfig

logger = logging.getLogger(__name__)

Mode = Literal["bubblewrap", "namespaces", "none"]
ISOLATED_MODES: tuple[Mode, ...] = ("bubblewrap", "namespaces")
WORK_DIR = "/sandbox"  # the program's cwd and only writable directory, inside the sandbox
_INIT_SOURCE = Path(__file__).with_name("sandbox_init.py").read_text()
_DEVICES = ("null", "zero", "full", "random", "urandom")
NOBODY = 65534  # a root caller's program runs as this uid, in every mode


class SandboxUnavailableError(RuntimeError):
    """No isolation works here and reward.sandbox.allow_unisolated is false."""


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None  # None when killed for the timeout
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    mode: Mode  # how the program was isolated; `none` only with reward.sandbox.allow_unisolated=true

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def isolated(self) -> bool:
        return self.mode in ISOLATED_MODES


# ------------------------------------------------------------------------------------------------ policy
_config: SandboxConfig | None = None


def configure(cfg: SandboxConfig) -> None:
    """Set the caps for this process (the reward manager calls it; forked scoring workers inherit it)."""
    global _config
    _config = cfg


def current_config() -> SandboxConfig:
    if _config is None:  # a caller that never configured (a script, a test) gets defaults.yaml's caps
        configure(build(SandboxConfig, load_defaults_dict()["reward"]["sandbox"], "reward.sandbox"))
    assert _config is not None
    return _config


def capped(key: str, requested: float | None, cap: float) -> float:
    """`requested` (e.g. a row's extra_info value) lowered to the configured cap; never raised above it."""
    if requested is None:
        return cap
    if isinstance(requested, bool) or not isinstance(requested, int | float) or not requested > 0:
        raise ValueError(f"sandbox limit {key}={requested!r}: must be a positive number (or omitted to use "
                         f"reward.sandbox.{key}={cap})")
    if requested > cap:
        _warn_capped(key, cap)
    return min(requested, cap)


@functools.cache
def _warn_capped(key: str, cap: float) -> None:
    logger.warning("a sandbox limit %s above reward.sandbox.%s=%s was lowered to the cap (rows may only lower "
                   "it; raise reward.sandbox.%s to allow more); logged once", key, key, cap, key)


# ------------------------------------------------------------------------------------------------- modes
_probe_errors: dict[str, str] = {}
_shared_budget: set[Mode] = set()  # modes where a root caller's program gets no user namespace of its own


@functools.cache
def available(mode: Mode) -> bool:
    """Whether `mode` works on this machine (probed once per process by running a tiny program in it)."""
    if mode == "none" and os.getuid() != 0:
        return True  # as root, mode none must be able to drop to uid 65534: probed below
    if mode == "bubblewrap" and shutil.which("bwrap") is None:
        _probe_errors[mode] = "bwrap not installed"
        return False
    if _probe(mode):
        return True
    if os.getuid() != 0:
        return False
    first_error = _probe_errors[mode]
    if not any(step in first_error for step in ("unshare(CLONE_NEWUSER)", "setgroups", "uid_map")):
        return False  # not the user namespace (a timeout on a busy host, a missing tool): no downgrade
    _shared_budget.add(mode)  # maybe only uid 65534 may not create a user namespace here (a sysctl, AppArmor)
    if not _probe(mode):
        _shared_budget.discard(mode)
        return False
    logger.warning("sandbox mode %s: uid %s cannot create a user namespace here (%s), so reward.sandbox."
                   "max_processes counts every uid-%s process on this host: concurrent sandboxes share it, and a "
                   "program may fail to start while another forks. Fix: allow unprivileged user namespaces",
                   mode, NOBODY, first_error, NOBODY)
    return True


def _probe(mode: Mode) -> bool:
    try:
        result = run_python("print('ok')", mode=mode)
    except OSError as err:
        _probe_errors[mode] = str(err)
        return False
    if result.stdout != "ok\n":
        _probe_errors[mode] = (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
    return result.stdout == "ok\n"


def unavailable_reason(mode: Mode) -> str:
    """Why `available(mode)` is False (the probe's last error line); empty when it works."""
    return "" if available(mode) else _probe_errors.get(mode, "unavailable")


def select_mode() -> Mode:
    """The mode `run_python` uses: the first isolated mode that works, else `none` only if allowed."""
    for mode in ISOLATED_MODES:
        if available(mode):
            return mode
    reasons = "; ".join(f"{m}: {unavailable_reason(m)}" for m in ISOLATED_MODES)
    if not current_config().allow_unisolated:
        raise SandboxUnavailableError(
            f"refusing to run code rewards unisolated: no sandbox works here ({reasons}). Fix: install bubblewrap "
            "(apt-get install bubblewrap) or allow unprivileged user namespaces, or set "
            "reward.sandbox.allow_unisolated=true to run policy code with rlimits only")
    if not available("none"):
        raise SandboxUnavailableError(
            "refusing to run code rewards unisolated as root: reward.sandbox.allow_unisolated=true runs them as uid "
            f"{NOBODY} (reward.sandbox.max_processes is an RLIMIT_NPROC, which never binds uid 0), and that failed "
            f"here ({unavailable_reason('none')}; no sandbox works: {reasons}). Fix: install bubblewrap "
            "(apt-get install bubblewrap), or train as a non-root user, or use a Python install that uid "
            f"{NOBODY} can run (not under a private home such as /root)")
    _warn_unisolated(reasons)
    return "none"


@functools.lru_cache(maxsize=1)
def _warn_unisolated(reasons: str) -> None:
    logger.warning("code rewards run UNISOLATED (reward.sandbox.allow_unisolated=true): policy code can read and "
                   "write your files and use the network (%s)", reasons)


# ------------------------------------------------------------------------------------------------ layout
def _default_python() -> str:
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))  # never a venv: the tree stays out


def _layout(python: str) -> tuple[list[list[str]], list[list[str]]]:
    """(read-only binds, symlinks) that let `python` start: /usr, the merged-/usr top dirs, its install prefix."""
    binds, symlinks = [["/usr", "/usr"]], []
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            symlinks.append([os.readlink(top), top])
        elif os.path.isdir(top):
            binds.append([top, top])
    prefix = str(Path(python).parents[1])
    if prefix != "/usr" and not prefix.startswith("/usr/"):
        binds.append([prefix, prefix])
    if os.path.exists("/etc/ld.so.cache"):
        binds.append(["/etc/ld.so.cache", "/etc/ld.so.cache"])
    return binds, symlinks


def _package_dirs(binds: list[list[str]]) -> list[str]:
    """Third-party package dirs inside the binds (site-packages, Debian's dist-packages): each gets an empty
    read-only tmpfs on top, so the program sees the standard library only, even through sys.path edits."""
    found = set()
    for _, dst in binds:
        for lib in (dst, os.path.join(dst, "lib"), os.path.join(dst, "lib64"), os.path.join(dst, "local", "lib")):
            for name in ("site-packages", "dist-packages"):
                found.update(p for p in glob.glob(os.path.join(lib, "python*", name)) if os.path.isdir(p))
    return sorted(found)


def _limits(cfg: SandboxConfig, timeout_s: float, memory_mb: int) -> dict[str, int]:
    return {"memory_mb": memory_mb, "cpu_s": int(timeout_s) + 1, "file_mb": cfg.max_output_mb,
            "processes": cfg.max_processes}


def _bwrap_argv(python: str, code_fd: int, spec: dict[str, Any], disk_mb: int) -> list[str]:
    argv = ["bwrap", "--die-with-parent", "--new-session", "--unshare-ipc", "--unshare-pid", "--unshare-net",
            "--unshare-uts", "--unshare-cgroup-try"]
    if os.getuid() == 0:  # root: bwrap's user namespace would map 65534 to root; the launcher drops to real 65534
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user", "--uid", "65534", "--gid", "65534", "--disable-userns"]
    binds, symlinks = _layout(python)
    parents = sorted({str(p) for _, dst in binds for p in Path(dst).parents if str(p) != "/"})
    for parent in parents:  # bwrap would create them 0700: unreadable once the program drops to uid 65534
        argv += ["--perms", "0755", "--dir", parent]
    for src, dst in binds:
        argv += ["--ro-bind", src, dst]
    for target, dst in symlinks:
        argv += ["--symlink", target, dst]
    for hidden in _package_dirs(binds):
        argv += ["--size", "65536", "--perms", "0555", "--tmpfs", hidden, "--remount-ro", hidden]
    argv += ["--dev", "/dev", "--perms", "1777", "--size", str(disk_mb << 20), "--tmpfs", WORK_DIR,
             "--perms", "0644", "--file", str(code_fd), f"{WORK_DIR}/main.py", "--chdir", WORK_DIR, "--remount-ro", "/", "--"]
    return argv + [python, "-I", "-S", "-c", _INIT_SOURCE, json.dumps(spec)]


def _command(mode: Mode, python: str, tmp: Path, fds: list[int], spec: dict[str, Any], disk_mb: int) -> list[str]:
    code_fd, root = fds[0], os.getuid() == 0
    if root:  # the program's uid 65534 gets a user namespace of its own (sandbox_init._drop_privileges says why)
        spec = {**spec, "own_userns": mode not in _shared_budget, "proc_fd": fds[1] if len(fds) > 1 else None}
    if mode == "bubblewrap":
        return _bwrap_argv(python, code_fd, {**spec, "stage": "exec", "drop": "setuid" if root else "none"}, disk_mb)
    launcher = [python, "-I", "-S", "-c", _INIT_SOURCE]
    if mode == "namespaces":
        binds, symlinks = _layout(python)
        binds += [[f"/dev/{d}", f"/dev/{d}"] for d in _DEVICES]
        (tmp / "root").mkdir()
        spec = {**spec, "stage": "namespaces", "drop": "setuid" if root else "userns", "root_dir": str(tmp / "root"),
                "binds": binds, "symlinks": symlinks, "hidden": _package_dirs(binds), "work_dir": WORK_DIR,
                "disk_mb": disk_mb, "code_fd": code_fd, "parent_pid": os.getpid()}
        return launcher + [json.dumps(spec)]
    shutil.copy(tmp / "main.py", tmp / "work" / "main.py")  # mode none: a host temp dir
    if root:  # RLIMIT_NPROC never binds uid 0: the program runs as uid 65534, which it does bind
        os.chmod(tmp, 0o711)
        os.chown(tmp / "work", NOBODY, NOBODY)
    return launcher + [json.dumps({**spec, "stage": "exec", "drop": "setuid" if root else "none",
                                   "parent_pid": os.getpid()})]


# --------------------------------------------------------------------------------------------------- run
def run_python(code: str, stdin: str = "", timeout_s: float | None = None, memory_mb: int | None = None,
               mode: Mode | None = None, python: str | None = None) -> SandboxResult:
    """Run `code` as `python -I main.py` in the sandbox. `timeout_s`/`memory_mb` may only lower the caps of
    reward.sandbox; `mode=None` picks the best available (raises SandboxUnavailableError when none is allowed)."""
    cfg = current_config()
    timeout = capped("timeout_s", timeout_s, cfg.timeout_s)
    memory = int(capped("memory_mb", memory_mb, cfg.memory_mb))
    mode = mode or select_mode()
    python = python or _default_python()
    spec = {"limits": _limits(cfg, timeout, memory), "argv": [python, "-I", "main.py"]}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hybridflow-sandbox-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "main.py").write_text(code)
        (tmp / "stdin.txt").write_text(stdin)
        (tmp / "work").mkdir()
        fds = [os.open(tmp / "main.py", os.O_RDONLY)]
        if mode == "bubblewrap" and os.getuid() == 0 and mode not in _shared_budget:
            fds.append(os.open("/proc", os.O_PATH | os.O_DIRECTORY))  # bwrap mounts none; the launcher closes it
        try:
            argv = _command(mode, python, tmp, fds, spec, cfg.disk_mb)
            returncode, timed_out = _execute(argv, tmp, fds, timeout, mode)
        finally:
            for fd in fds:
                os.close(fd)
        limit = cfg.max_output_mb * 1024 * 1024
        stdout = (tmp / "out").read_bytes()[:limit].decode("utf-8", "replace")
        stderr = (tmp / "err").read_bytes()[:limit].decode("utf-8", "replace")
    return SandboxResult(returncode, stdout, stderr, timed_out, time.monotonic() - start, mode)


def _execute(argv: list[str], tmp: Path, fds: list[int], timeout_s: float, mode: Mode) -> tuple[int | None, bool]:
    home = WORK_DIR if mode in ISOLATED_MODES else str(tmp / "work")
    env = {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "PYTHONHASHSEED": "0",
           "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
    with open(tmp / "stdin.txt", "rb") as fin, open(tmp / "out", "wb") as fout, open(tmp / "err", "wb") as ferr:
        (tmp / "stdin.txt").unlink()  # reachable only as the program's fd 0 (the code harness's nonce is in it)
        proc = subprocess.Popen(argv, cwd=tmp / "work", env=env, stdin=fin, stdout=fout, stderr=ferr,
                                start_new_session=True, close_fds=True, pass_fds=fds)
        exited = _wait_unreaped(proc.pid, timeout_s)
        # The group holds the launcher and the sandbox's pid 1, whose death takes the pid namespace with it; in
        # mode none, the program's children too (else a fork bomb would outlive the run). Killed before the
        # launcher is reaped, so the group id cannot have been reused.
        with contextlib.suppress(ProcessLookupError):  # the whole group already exited
            os.killpg(proc.pid, signal.SIGKILL)
        returncode = proc.wait()
        return (returncode, False) if exited else (None, True)


def _wait_unreaped(pid: int, timeout_s: float) -> bool:
    """Wait until child `pid` exits, leaving it unreaped (WNOWAIT); False when `timeout_s` passed first."""
    deadline, delay = time.monotonic() + timeout_s, 0.001
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(2 * delay, 0.02)
    return True


__all__ = ["ISOLATED_MODES", "Mode", "SandboxResult", "SandboxUnavailableError", "available", "configure",
           "current_config", "run_python", "select_mode",
           "unavailable_reason"]
