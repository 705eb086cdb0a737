"""The `code` reward's test harness: the sandbox's main.py when a row has `test_code` (stdlib only; it runs inside
the sandbox). stdin = a nonce line, then JSON {"program": ..., "tests": ...}.

Only finished tests can report a pass: after the tests return, the harness writes `<nonce> passed` to the stdout
it saved before the program ran, and ends the process (os._exit). Exiting early, exit code 0, atexit, signals,
patched builtins or a faked stdout therefore score 0. The program cannot forge the line: the nonce is read before
the program runs (fd 0 is then /dev/null) and is held only in a local of the thread that runs program and tests;
an audit hook, installed first and irremovable, denies what could reach it (frames, gc, tracing, ctypes, new
processes, /proc); and that thread is not the main one, so the program cannot install a signal handler (which
would receive a frame). The tests see the program's globals, as if appended to it, but unpatched builtins.
"""

from __future__ import annotations

import _thread
import builtins
import json
import os
import sys
import types

DENIED_EVENTS = frozenset({
    "sys._getframe", "sys._getframemodulename", "sys._current_frames", "sys._current_exceptions",
    "sys.settrace", "sys.setprofile", "sys.addaudithook", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
    "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen",
    "code.__new__",  # hand-built bytecode can read memory
})
DENIED_MODULES = frozenset({"ctypes", "_ctypes", "_ctypes_test", "_posixsubprocess", "_testcapi",
                            "_testinternalcapi", "_xxsubinterpreters", "_xxinterpchannels"})
FRAME_ATTRIBUTES = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame"})
PASSED = b" passed\n"


class FrameAccessDenied(ValueError):
    """A ValueError, as for a too-deep sys._getframe: namedtuple, enum, typing and logging then fall back."""


def _audit(event: str, args: tuple, _denied=DENIED_EVENTS, _modules=DENIED_MODULES, _attrs=FRAME_ATTRIBUTES,
           _isinstance=builtins.isinstance, _str=str, _bytes=bytes, _frame=FrameAccessDenied,
           _error=PermissionError, _int=int, _fsdecode=os.fsdecode, _realpath=os.path.realpath) -> None:
    # Defaults bind everything used here: the program may patch builtins and modules, not these references.
    if event in _denied:
        raise (_frame if event.startswith("sys._") else _error)(f"{event} is not allowed in a code reward")
    if event.startswith("ctypes."):
        raise _error(f"{event} is not allowed in a code reward")
    if event == "import" and args[0] in _modules:
        raise _error(f"import {args[0]} is not allowed in a code reward")
    if event == "object.__getattr__" and args[1] in _attrs:
        raise _error(f"reading {args[1]} is not allowed in a code reward")
    if event == "open" and args[0] is not None and not _isinstance(args[0], _int):
        # the resolved path: "//proc", "/x/../proc", a Path, or a relative path after chdir("/proc") all count
        path = _realpath(_fsdecode(args[0]))
        if path == "/proc" or path.startswith("/proc/"):
            raise _error("opening /proc is not allowed in a code reward")


def _read_stdin() -> bytes:
    chunks = []
    while chunk := os.read(0, 1 << 16):
        chunks.append(chunk)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return b"".join(chunks)


def _write_source(name: str, source: str) -> str:
    """Save `source` in the cwd so that tracebacks show its lines; returns the path compiled under."""
    path = os.path.abspath(name)
    try:
        with open(path, "w") as out:
            out.write(source)
    except OSError as err:  # a full tmpfs costs only the source lines in tracebacks
        os.write(2, f"code harness: cannot save {name} ({err}); tracebacks will lack source lines\n".encode())
    return path


def run() -> None:
    """The program and tests' thread; its locals hold the nonce, and it ends the process."""
    write, exit_now, excepthook, run_code = os.write, os._exit, sys.__excepthook__, exec
    flushes = (sys.stdout.flush, sys.stderr.flush)  # the real streams' (C) methods: the program may replace them
    try:
        nonce, _, payload = _read_stdin().partition(b"\n")
        verdict = b"\n" + nonce + PASSED  # on a line of its own, whatever the program printed last
        spec = json.loads(payload)
        out = os.dup(1)
        program = compile(spec["program"], _write_source("program.py", spec["program"]), "exec")
        tests = compile(spec["tests"], _write_source("tests.py", spec["tests"]), "exec")
        pristine = dict(builtins.__dict__)
        module = types.ModuleType("__main__")
        module.__dict__.update(__builtins__=builtins, __file__=program.co_filename)
        sys.modules["__main__"] = module
        del nonce, payload, spec
    except BaseException as err:  # noqa: BLE001 — a malformed payload is a harness failure: say so, exit 1
        write(2, f"code harness: bad input: {err!r}\n".encode())
        exit_now(2)
    sys.addaudithook(_audit)
    try:
        run_code(program, module.__dict__)
        module.__dict__["__builtins__"] = pristine
        run_code(tests, module.__dict__)
    except BaseException as err:  # noqa: BLE001 — whatever the program or tests raise (SystemExit too) fails
        try:
            excepthook(err.__class__, err, err.__traceback__)
            _flush(flushes)
        finally:
            exit_now(1)
    _flush(flushes)
    write(out, verdict)
    exit_now(0)


def _flush(flushes: tuple) -> None:
    """Keep what the program printed (os._exit skips the flush at exit); a stream it closed has nothing to keep."""
    for flush in flushes:
        try:
            flush()
        except (OSError, ValueError):
            continue


def main() -> None:
    _thread.start_new_thread(run, ())
    forever = _thread.allocate_lock()
    forever.acquire()
    forever.acquire()  # `run` ends the process


if __name__ == "__main__":
    main()
