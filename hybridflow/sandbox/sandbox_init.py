"""The sandbox's trusted first process, run as `python -I -S -c <this file's source> <json spec>` (stdlib only:
under bubblewrap it runs inside the sandbox, where the project tree is invisible).

Stage `exec` sets the rlimits, drops to uid 65534 (a root caller's program also gets a user namespace of its own,
so that RLIMIT_NPROC counts its sandbox's processes only), sets no_new_privs and execs the program. Stage `namespaces`
(the fallback when bubblewrap is missing) first builds the sandbox itself: new mount/pid/net/ipc/uts namespaces,
a tmpfs root holding read-only binds of what Python needs (package dirs under an empty tmpfs) plus a size-limited
tmpfs work dir, pivot_root; the program runs as pid 1 of its namespace, so when it or this launcher dies every
process inside dies with it.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import signal
import sys
from typing import Any

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH, PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 2, 1, 4, 38
# Flags a user namespace may not clear on a bind remount (the kernel locks them): keep what the source has.
LOCKED_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME | MS_RELATIME
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
NOBODY = 65534
_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if s is None else s.encode() for s in (src, dst, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {src} on {dst}")


def _write(path: str, text: str, dir_fd: int | None = None) -> None:
    fd = os.open(path, os.O_WRONLY, dir_fd=dir_fd)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------- exec stage
def _die_with_parent(parent_pid: int | None = None) -> None:
    """SIGKILL us when our parent dies; `parent_pid` (when visible) closes the race with a parent already gone."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(137)


def _set_limits(limits: dict[str, int]) -> None:
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _new_userns(proc_fd: int, outside: int) -> None:
    """Enter a new user namespace where uid/gid 65534 is `outside` of the current one."""
    _check(_libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
    _write("setgroups", "deny", proc_fd)
    _write("uid_map", f"{NOBODY} {outside} 1", proc_fd)
    _write("gid_map", f"{NOBODY} {outside} 1", proc_fd)


def _drop_privileges(how: str, proc_fd: int | None) -> None:
    """setuid: real root → uid/gid 65534 (clears all capabilities), then, given `proc_fd`, into a user namespace of
    its own that maps 65534 to itself. userns: uid 0 of our own user namespace → uid 65534 of a nested one, which
    holds no power over the mounts already made."""
    if how == "setuid":
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
        if proc_fd is not None:
            # The kernel counts RLIMIT_NPROC per (user namespace, uid): in the host's, it counts every uid-65534
            # process (other sandboxes' programs), so a neighbour's fork bomb would stop this program from starting.
            # The uid change left us undumpable, so our /proc files are root's: dumpable again to write our id maps.
            _check(_libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")
            _new_userns(proc_fd, NOBODY)
    elif how == "userns":
        assert proc_fd is not None, "userns drop needs /proc/self opened before pivot_root"
        _new_userns(proc_fd, 0)
    if how != "none" and os.getuid() != NOBODY:
        raise OSError(f"privilege drop {how!r} left uid {os.getuid()}, expected {NOBODY}")


def _open_proc_self(spec: dict[str, Any]) -> int:
    """Our /proc/<pid> (O_PATH), through the host's /proc: bubblewrap mounts none, so it comes as an fd."""
    root = spec.get("proc_fd")
    fd = os.open("/proc/self" if root is None else "self", os.O_PATH | os.O_DIRECTORY, dir_fd=root)
    if root is not None:
        os.close(root)
    return fd


def exec_program(spec: dict[str, Any], proc_fd: int | None = None, alive_fd: int | None = None) -> None:
    if proc_fd is None and spec.get("own_userns"):
        proc_fd = _open_proc_self(spec)
    _set_limits(spec["limits"])
    _drop_privileges(spec["drop"], proc_fd)
    # After the drop: a user namespace's bound on its creator's whole uid is the creator's RLIMIT_NPROC at creation.
    resource.setrlimit(resource.RLIMIT_NPROC, (spec["limits"]["processes"],) * 2)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    if alive_fd is not None:
        # Set after the uid change (which clears it); the pipe closes the race with a launcher that already died.
        _die_with_parent()
        if select.select([alive_fd], [], [], 0)[0]:
            os._exit(137)
        os.close(alive_fd)
    elif spec.get("parent_pid"):
        _die_with_parent(spec["parent_pid"])
    if proc_fd is not None:
        os.close(proc_fd)
    argv = spec["argv"]
    os.execv(argv[0], argv)


# ------------------------------------------------------------------------------------- namespaces stage
def _bind_ro(src: str, dst: str) -> None:
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    _mount(src, dst, None, MS_BIND)
    locked = os.statvfs(dst).f_flag & LOCKED_FLAGS
    _mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | locked)


def _build_root(spec: dict[str, Any]) -> None:
    root = spec["root_dir"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for src, dst in spec["binds"]:
        _bind_ro(src, root + dst)
    for target, dst in spec["symlinks"]:
        os.symlink(target, root + dst)
    for hidden in spec["hidden"]:  # third-party packages: an empty read-only tmpfs on top
        _mount("tmpfs", root + hidden, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "size=64k,mode=555")
    work = root + spec["work_dir"]
    os.makedirs(work)
    _mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['disk_mb']}m,mode=1777")
    with open(os.path.join(work, "main.py"), "wb") as out:
        out.write(_read_all(spec["code_fd"]))
    os.chdir(root)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(f"pivot_root: no syscall number known for {os.uname().machine}")
    _check(_libc.syscall(number, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "umount2(old root)")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(spec["work_dir"])


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def _enter_namespaces(userns: bool) -> None:
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if not userns:
        _check(_libc.unshare(flags), "unshare")
        return
    uid, gid = os.getuid(), os.getgid()
    _check(_libc.unshare(flags | CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"0 {uid} 1")
    _write("/proc/self/gid_map", f"0 {gid} 1")


def run_namespaces(spec: dict[str, Any]) -> None:
    _enter_namespaces(spec["drop"] == "userns")
    _die_with_parent(spec["parent_pid"])  # after unshare: a credential change clears the death signal
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pid 1 of the new pid namespace
        os.close(alive_w)
        try:
            needs_proc = spec["drop"] == "userns" or spec.get("own_userns")
            proc_fd = _open_proc_self(spec) if needs_proc else None
            _build_root(spec)
            exec_program(spec, proc_fd, alive_r)
        except BaseException as err:  # noqa: BLE001 — report any setup failure, then exit without cleanup
            os.write(2, f"hybridflow sandbox setup failed: {err!r}\n".encode())
            os._exit(126)
    os.close(alive_r)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    os._exit(code if code >= 0 else 128 - code)


def main() -> None:
    spec = json.loads(sys.argv[1])
    if spec["stage"] == "namespaces":
        run_namespaces(spec)
    else:
        exec_program(spec)


if __name__ == "__main__":
    main()
