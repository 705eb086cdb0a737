"""The sandbox blocks each escape found by the fault tests in BOTH isolated modes — bubblewrap and our
own namespaces launcher: writes outside its tmpfs, reads of the project tree / host files / home, a `setsid`
grandchild outliving the timeout, `_socket` to a loopback listener, a fork bomb, an 8 GB allocation. It refuses
to run unisolated unless allowed, per-row limits only lower the caps, and the `code` scorer still scores."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridflow import sandbox
from hybridflow.config import load_config
from hybridflow.models.tokenizer import builtin_tokenizer
from hybridflow.rewards import REWARD_FUNCTIONS, RewardManager
from hybridflow.sandbox import SandboxUnavailableError, run_python

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=sandbox.ISOLATED_MODES)
def mode(request: pytest.FixtureRequest) -> str:
    if not sandbox.available(request.param):
        pytest.skip(f"sandbox mode {request.param} does not work here: {sandbox.unavailable_reason(request.param)}")
    return request.param


@pytest.fixture
def caps(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Tests that change reward.sandbox get the defaults back afterwards."""
    monkeypatch.setattr(sandbox, "_config", sandbox.current_config())
    yield


def _set_caps(**changes: object) -> None:
    sandbox.configure(dataclasses.replace(sandbox.current_config(), **changes))


def _processes_named(comm: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == comm:
                if "State:\tZ" not in (entry / "status").read_text():  # a zombie is dead, just not yet reaped
                    pids.append(int(entry.name))
        except OSError:
            continue  # exited while we looked
    return pids


def _wait_gone(comm: str, within_s: float = 3.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while (alive := _processes_named(comm)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


_NAME_ME = "import ctypes\nctypes.CDLL(None).prctl(15, {name!r}.encode(), 0, 0, 0)\n"  # PR_SET_NAME → comm
_RUN = str(os.getpid())  # in each name: a concurrent test run's processes (another worker, another user) are not ours


# ------------------------------------------------------------------------------------------ basics
def test_runs_code_with_stdin_in_a_private_dir(mode: str) -> None:
    r = run_python("import os\nprint(input()[::-1]); print(os.listdir('.'), os.getcwd(), os.getuid())",
                   stdin="abc", mode=mode)
    assert r.ok and r.mode == mode and r.isolated, r
    lines = r.stdout.splitlines()
    assert lines[0] == "cba" and "main.py" in lines[1] and sandbox.WORK_DIR in lines[1]
    if os.getuid() == 0:
        assert lines[1].endswith(" 65534"), "a root caller's program must run as uid 65534"


def test_write_outside_the_private_dir_is_blocked(mode: str, tmp_path: Path) -> None:
    tmp_path.chmod(0o777)  # writable by anyone on the host: only the sandbox can stop the write
    targets = [tmp_path / "escaped", REPO / "escaped", Path("/tmp/hybridflow-escaped"), Path("/usr/escaped"),
               Path(sys.base_prefix) / "escaped", Path("/escaped")]
    code = ("import os\nfor p in %r:\n    try:\n        open(p, 'w').write('x')\n        print('WROTE', p)\n"
            "    except OSError as e:\n        print('blocked', p, e.errno)\nopen('ok.txt', 'w').write('fine')\n"
            "print(open('ok.txt').read())\n" % [str(t) for t in targets])
    r = run_python(code, mode=mode)
    assert r.ok and "WROTE" not in r.stdout and r.stdout.count("blocked") == len(targets), r
    assert r.stdout.strip().endswith("fine")
    assert not any(t.exists() for t in targets)


def test_private_dir_is_size_limited(mode: str) -> None:
    code = ("import os\nn = 0\ntry:\n    for i in range(1000):\n        with open(f'f{i}', 'wb') as f:\n"
            "            f.write(b'x' * (4 << 20))\n        n += 4\nexcept OSError as e:\n    print('stopped', n, e.errno)")
    r = run_python(code, mode=mode)
    assert r.ok and r.stdout.startswith("stopped"), r
    assert int(r.stdout.split()[1]) <= sandbox.current_config().disk_mb


def test_project_tree_host_files_and_home_are_invisible(mode: str) -> None:
    home = Path.home()
    python_prefix = Path(sys.base_prefix)
    home_entries = [p for p in home.iterdir() if p not in python_prefix.parents][:5]  # what the host has there
    secrets = [REPO / "pyproject.toml", REPO / "hybridflow", Path("/etc/hostname"), Path("/etc/passwd"),
               Path("/work"), *home_entries]
    code = ("import os\nfor p in %r:\n    print('SEEN' if os.path.exists(p) else 'hidden', p)\n"
            % [str(p) for p in secrets])
    r = run_python(code, mode=mode)
    assert r.ok and r.stdout.count("hidden") == len(secrets), r.stdout + r.stderr


def test_only_the_standard_library_is_importable(mode: str) -> None:
    base = sandbox._default_python()
    on_host = [name for name in ("yaml", "IPython", "attr", "certifi", "numpy")  # whichever the host has
               if subprocess.run([base, "-I", "-c", f"import {name}"], capture_output=True).returncode == 0]
    hidden = sandbox._package_dirs(sandbox._layout(base)[0])  # even when the program puts them on sys.path
    code = (f"import importlib.util, json, os, sys\nsys.path += {hidden!r}\n"
            f"found = [n for n in {on_host!r} if importlib.util.find_spec(n)]\n"
            f"listed = [p for d in {hidden!r} for p in os.listdir(d)]\n"
            "import decimal, sqlite3\nprint(json.dumps({'found': found, 'listed': listed}))\n")
    r = run_python(code, mode=mode)
    assert r.ok, r
    assert json.loads(r.stdout) == {"found": [], "listed": []}, (on_host, hidden, r.stdout)


# ---------------------------------------------------------------------------------------- processes
def test_setsid_grandchild_dies_at_the_timeout(mode: str, tmp_path: Path) -> None:
    tmp_path.chmod(0o777)
    late = tmp_path / "written-after-the-timeout"
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            + "".join("        " + line + "\n" for line in _NAME_ME.format(name="hfsetsid" + _RUN).splitlines())
            + f"        time.sleep(1.5)\n        open({str(late)!r}, 'w').write('escaped')\n"
            "    os._exit(0)\ntime.sleep(60)\n")
    start = time.monotonic()
    r = run_python(code, timeout_s=1.0, mode=mode)
    assert r.timed_out and r.duration_s < 3, r
    assert _wait_gone("hfsetsid" + _RUN) == [], "the setsid grandchild survived the sandbox"
    time.sleep(max(0.0, start + 2.5 - time.monotonic()))  # past the grandchild's write time
    assert not late.exists()


def test_fork_bomb_is_bounded_and_killed(mode: str) -> None:
    limit = sandbox.current_config().max_processes
    # at most 4x the limit: if the limit did not hold, the count says so instead of the loop outliving the timeout
    code = ("import os, time\nn = 0\nfor _ in range(" + str(4 * limit) + "):\n    try:\n        pid = os.fork()\n"
            "    except OSError:\n        break\n    if pid == 0:\n"
            + "".join("        " + line + "\n" for line in _NAME_ME.format(name="hfbomb" + _RUN).splitlines())
            + "        time.sleep(60)\n        os._exit(0)\n    n += 1\nprint(n, flush=True)\ntime.sleep(60)\n")
    # the bomb must reach the process limit and print before the timeout: 1.5 s was too short on a busy 2-core box
    r = run_python(code, timeout_s=4.0, mode=mode)
    assert r.timed_out and r.stdout.strip(), r
    assert int(r.stdout) < limit
    assert _wait_gone("hfbomb" + _RUN) == [], "fork-bomb processes outlived the sandbox"


def test_a_busy_neighbour_of_the_same_uid_leaves_the_process_budget_alone(mode: str) -> None:
    """RLIMIT_NPROC counts a uid's processes per user namespace: the program's count must be its own sandbox's, not
    every process on the host with its uid (another sandbox's fork bomb, a caller's threads), else it cannot start."""
    if mode in sandbox._shared_budget:
        pytest.skip(f"uid {sandbox.NOBODY} cannot create a user namespace here: sandboxes share one process budget")
    limit = sandbox.current_config().max_processes
    as_nobody = {"user": sandbox.NOBODY, "group": sandbox.NOBODY, "extra_groups": []} if os.getuid() == 0 else {}
    neighbour = subprocess.Popen(["/bin/sh", "-c", f"for i in $(seq {limit}); do sleep 30 & done; echo ready; wait"],
                                 stdout=subprocess.PIPE, start_new_session=True, **as_nobody)
    try:
        assert neighbour.stdout is not None and neighbour.stdout.readline() == b"ready\n"
        r = run_python("import os\nfor _ in range(4):\n    if os.fork() == 0:\n        os._exit(0)\n"
                       "    os.wait()\nprint('forked')", mode=mode)
    finally:
        os.killpg(neighbour.pid, signal.SIGKILL)
        neighbour.wait()
    assert r.ok and r.stdout == "forked\n", r


@pytest.mark.skipif(os.getuid() != 0, reason="only a root caller's program is given a user namespace by us")
def test_root_falls_back_to_a_shared_budget_where_nobody_cannot_create_a_user_namespace(
        mode: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(sandbox, "_shared_budget", set())
    monkeypatch.setattr(sandbox, "_probe", lambda m: m in sandbox._shared_budget)  # the user namespace fails
    monkeypatch.setitem(sandbox._probe_errors, mode, "timed out after 5s")  # a busy host, not the namespace
    assert not sandbox.available.__wrapped__(mode) and not sandbox._shared_budget
    monkeypatch.setitem(sandbox._probe_errors, mode, "unshare(CLONE_NEWUSER): Operation not permitted")
    assert sandbox.available.__wrapped__(mode) and sandbox._shared_budget == {mode}
    assert "max_processes counts every uid-65534 process" in caplog.text and "not permitted" in caplog.text
    r = run_python("import os\nprint(os.getuid())", mode=mode)  # the program still runs, as uid 65534
    assert r.ok and r.stdout == "65534\n", r


def test_8gb_allocation_fails(mode: str) -> None:
    r = run_python("b = bytearray(8 << 30)\nprint('allocated')", mode=mode)
    assert not r.ok and not r.timed_out and "MemoryError" in r.stderr and "allocated" not in r.stdout, r


# ------------------------------------------------------------------------------------------ network
def test_no_network_even_through__socket(mode: str) -> None:
    tcp = socket.create_server(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(f"\0hybridflow-sandbox-test-{os.getpid()}")  # abstract: no file, scoped by network namespace
    unix.listen()
    tcp.setblocking(False)
    unix.setblocking(False)
    targets = [("_socket.AF_INET", ("127.0.0.1", tcp.getsockname()[1])), ("_socket.AF_UNIX", unix.getsockname())]
    code = ("import _socket\n"
            f"for family, addr in [{', '.join(f'({fam}, {addr!r})' for fam, addr in targets)}]:\n"
            "    s = _socket.socket(family, _socket.SOCK_STREAM)\n    s.settimeout(2)\n"
            "    try:\n        s.connect(addr)\n        print('CONNECTED', family)\n"
            "    except OSError as e:\n        print('blocked', family, e)\n")
    with tcp, unix:
        r = run_python(code, mode=mode)
        assert r.ok and "CONNECTED" not in r.stdout and r.stdout.count("blocked") == 2, r
        for server in (tcp, unix):
            with pytest.raises(BlockingIOError):
                server.accept()


# ------------------------------------------------------------------------ timeouts and limits (default mode)
def test_infinite_loop_is_killed_at_the_timeout() -> None:
    start = time.monotonic()
    r = run_python("while True:\n    pass", timeout_s=1.0)
    assert r.timed_out and not r.ok and r.returncode is None
    assert time.monotonic() - start < 5


def test_memory_bomb_is_stopped() -> None:
    r = run_python("a = []\nwhile True:\n    a.append(bytearray(10**7))", memory_mb=256)
    assert not r.ok and not r.timed_out and "MemoryError" in r.stderr


def test_output_flood_is_bounded(caps: None) -> None:
    _set_caps(max_output_mb=1)
    r = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)")
    assert not r.ok and len(r.stdout) <= 1024 * 1024


def test_per_call_and_per_row_limits_only_lower_the_caps(caps: None) -> None:
    _set_caps(timeout_s=1.0, memory_mb=128)
    r = run_python("while True:\n    pass", timeout_s=60.0)
    assert r.timed_out and r.duration_s < 3, "a per-call timeout raised the cap"
    r = run_python("b = bytearray(300 << 20)\nprint('allocated')", memory_mb=100_000)
    assert "MemoryError" in r.stderr and "allocated" not in r.stdout, "a per-call memory_mb raised the cap"
    code = REWARD_FUNCTIONS["code"]
    sleepy = "```python\nimport time\ntime.sleep(3)\n```"
    start = time.monotonic()
    assert code("code", sleepy, {"test_code": "pass"}, {"timeout_s": 100, "memory_mb": 100_000})["score"] == 0.0
    assert time.monotonic() - start < 3
    alloc = "```python\nb = bytearray(300 << 20)\n```"
    assert code("code", alloc, {"test_code": "pass"}, {"memory_mb": 100_000})["score"] == 0.0
    with pytest.raises(ValueError, match="timeout_s='fast'"):
        code("code", sleepy, {"test_code": "pass"}, {"timeout_s": "fast"})


# ---------------------------------------------------------------------------------- refusal when unisolated
def test_refuses_to_run_unisolated_unless_allowed(caps: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "available", lambda mode: mode == "none")
    with pytest.raises(SandboxUnavailableError, match="reward.sandbox.allow_unisolated=true"):
        run_python("print(1)")
    with pytest.raises(SandboxUnavailableError, match="install bubblewrap"):
        REWARD_FUNCTIONS["code"]("code", "```python\nprint(1)\n```", {"test_code": "pass"}, None)
    cfg = load_config([], ["reward.sources=[{name: code, weight: 1.0}]"]).reward
    with pytest.raises(SandboxUnavailableError, match="allow_unisolated"):
        RewardManager(cfg, builtin_tokenizer(), 16)
    _set_caps(allow_unisolated=True)
    if os.getuid() == 0:  # a root caller's program runs as uid 65534, which must be able to run that Python
        python = _python_nobody_can_run()
        if python is None:
            pytest.skip("no Python here that uid 65534 can run (the refusal is tested below)")
        monkeypatch.setattr(sandbox, "_default_python", lambda: python)
    r = run_python("print(1)")
    assert r.ok and r.mode == "none" and not r.isolated, r


def _python_nobody_can_run() -> str | None:
    """A Python whose every parent directory lets others through (the host's venv base may sit under /root)."""
    for python in (sandbox._default_python(), "/usr/bin/python3"):
        path = Path(os.path.realpath(python))
        if path.exists() and all(p.stat().st_mode & 0o001 for p in path.parents):
            return str(path)
    return None


@pytest.mark.skipif(os.getuid() != 0, reason="RLIMIT_NPROC binds a non-root caller's uid already")
def test_unisolated_root_caller_runs_code_as_nobody_under_the_process_cap(caps: None,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    python = _python_nobody_can_run()
    if python is None:
        pytest.skip("no Python here that uid 65534 can run (the refusal is tested below)")
    monkeypatch.setattr(sandbox, "_default_python", lambda: python)
    # the process cap is under test, not time: 15 s, not the 5 s default (two interpreters start and 15 forks run
    # before the print; a loaded 2-core box took 5.4 s once)
    _set_caps(allow_unisolated=True, max_processes=16, timeout_s=15.0)
    code = ("import os, time\nn = 0\nfor _ in range(100):\n    try:\n        pid = os.fork()\n"
            "    except OSError:\n        break\n    if pid == 0:\n"
            + "".join("        " + line + "\n" for line in _NAME_ME.format(name="hfnone" + _RUN).splitlines())
            + "        time.sleep(60)\n        os._exit(0)\n    n += 1\nprint(n, os.getuid(), flush=True)\n")
    r = run_python(code, timeout_s=15.0, mode="none")
    assert r.ok and r.mode == "none", r
    forked, uid = map(int, r.stdout.split())
    assert uid == 65534 and forked < 16, r.stdout
    assert _wait_gone("hfnone" + _RUN) == [], "the program's children outlived its run"


@pytest.mark.skipif(os.getuid() != 0, reason="only a root caller's unisolated mode drops to uid 65534")
def test_unisolated_root_caller_is_refused_when_nobody_cannot_run_python(caps: None,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox, "available", lambda mode: False)
    monkeypatch.setitem(sandbox._probe_errors, "none", "PermissionError: [Errno 13] Permission denied")
    _set_caps(allow_unisolated=True)
    with pytest.raises(SandboxUnavailableError, match=r"(?s)as root.*RLIMIT_NPROC.*Permission denied.*"
                                                      r"install bubblewrap.*non-root user"):
        run_python("print(1)")


def test_code_scorer_rejects_an_unisolated_result_when_not_allowed(caps: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridflow.rewards import code as code_module

    unisolated = sandbox.SandboxResult(0, "", "", False, 0.0, "none")
    monkeypatch.setattr(code_module, "run_python", lambda *a, **k: unisolated)
    with pytest.raises(RuntimeError, match="allow_unisolated=false"):
        REWARD_FUNCTIONS["code"]("code", "```python\npass\n```", {"test_code": "pass"}, None)


# ------------------------------------------------------------------------------------------ code scorer
def test_code_scorer_io_tests_and_test_code() -> None:
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
