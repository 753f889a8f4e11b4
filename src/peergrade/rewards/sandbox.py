"""Run untrusted Python programs (model completions) in a constrained child process.

The code reward executes text written by the policy: this module is the one place where
untrusted code runs. ``run_program`` runs one program and always returns a ``SandboxResult``
(it never raises for anything the program does); ``run_many`` runs a list of programs through
a bounded pool of supervising threads, each of which owns one child process at a time.

Mechanisms, and failing closed
------------------------------
``mechanism="auto"`` (the default) uses the first of these that works here (``select_mechanism``
probes them once per process, in this order):

1. ``root``: we are root with CAP_SYS_ADMIN. The launcher unshares mount, PID, network, IPC
   and UTS namespaces directly and the program runs under a per-program host uid.
2. ``userns``: an unprivileged user namespace, created together with the others, the way
   bubblewrap and nsjail do it. It maps one id onto itself (all an ordinary user may map); the
   launcher holds every capability inside the namespace until the program's ``execve`` drops
   them. Root without CAP_SYS_ADMIN (a default container) first switches to the per-program uid,
   so a program never runs as host uid 0.

When neither works, every program ends ``sandbox_error`` without running, with a reason that
says what is missing and how to fix it: nothing runs unsandboxed unless asked for with
``mechanism="none"`` (``isolate=False``): rlimits, a new session and a group kill only. The
code reward goes one step further before its first use: ``require_sandbox`` runs a canary
(``self_test``) that tries to write outside, read a secret file in ``$HOME`` and this process's
environment, see this process and reach a listener of ours, and raises ``SandboxUnavailable``
(one message: what escaped or is missing, and the fixes) unless everything was contained.

How one program runs
--------------------
The supervisor (this process) writes the program to ``main.py`` in a fresh temp directory and
starts a *launcher*: this same file run as ``python -I -S sandbox.py <config>``, in a new
session (its own process group). Under ``root`` or ``userns`` the launcher:

1. reads the work directory's files into memory and unshares the namespaces (above);
2. makes every mount private, covers the homes (``/root``, ``/home``, the trainer's ``$HOME``),
   the temp directories (``/tmp``, ``/var/tmp``, ``/dev/shm``, ``$TMPDIR``) and ``/run``
   (sockets such as docker.sock or D-Bus, reachable without a network) with an empty tmpfs,
   into which only the interpreter's prefix directories are bind-mounted back, then remounts
   every mount read-only and nosuid; a mount that cannot be made read-only is a setup error;
3. mounts a size-capped tmpfs (``disk_mb``) owned by the program's uid over the work directory
   and writes the files back into it: the program's files never touch the disk;
4. forks a minimal init, PID 1 of the new PID namespace, which starts a session of its own
   (so the program's process group never holds the launcher), mounts a fresh ``/proc`` (only
   the namespace's processes) and forks the program (PID 2). The program's process sets the
   resource limits, under ``root`` drops to the per-program uid/gid (no supplementary groups),
   sets ``PR_SET_NO_NEW_PRIVS`` and ``PR_SET_PDEATHSIG`` and execs ``python -I main.py`` with a
   minimal environment. The init reaps orphans and reports the program's wait status and CPU
   time on a private pipe, and first that the program's ``execve`` succeeded: from then on an
   init or launcher that ends without a report, or a setup failure on the pipe, is the
   program's doing (``tampered``), not ``sandbox_error``. The launcher stays outside the PID
   namespace and waits for the init.

Resource limits (``setrlimit``): RLIMIT_CPU (CPU seconds, per process), RLIMIT_AS (address
space, per process), RLIMIT_NPROC (processes of the program's uid: unique per program under
``root``; under ``userns`` counted per user namespace since Linux 5.14, so also per program),
RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE = 0.

The supervisor reads stdout and stderr with a byte cap (beyond it: kill, ``output_limit``) and a
wall-clock deadline (beyond it: kill, ``timeout``). Killing is SIGKILL to the namespace's init,
upon which the kernel kills every process left in that namespace (including ones that called
``setsid()`` to leave the process group), then ``killpg(SIGKILL)`` of the launcher's group.
The temp directory is removed afterwards.

Threat model
------------
Adversary: a program that tries to hang, exhaust CPU/memory/processes/output/disk, write or
read outside its directory, read the trainer's secrets (environment, files in ``$HOME``), reach
the network, or signal the trainer or other programs. See docs/sandbox.md for what is enforced
on which setup. Not defended against: kernel exploits (no seccomp filter, no VM boundary),
reading world-readable files outside the covered directories (they are visible, only
read-only; under ``userns`` the program is the trainer's own uid, so the trainer's files there
are readable too), total memory of a program that forks (RLIMIT_AS is per process), and CPU
time of the pool as a whole beyond ``workers`` cores. What was in force is recorded in
``SandboxResult.enforced``.

What this module deliberately does not do: score programs (see ``peergrade.rewards.code``),
install packages for programs, run anything but Python, or use bubblewrap or setuid helpers
(the kernel interfaces they use are called directly, so there is nothing to install).
"""

from __future__ import annotations

import marshal
import os
import sys

# This file doubles as the launcher script (``python -I -S sandbox.py``): the launcher part
# comes first and ends in ``_launcher_main``, which never returns, so the launcher does not pay
# for the supervisor's imports below (a third of the per-program start-up time).

STATUSES = (
    "ok",
    "error",
    "timeout",
    "memory",
    "output_limit",
    "killed",
    "tampered",
    "sandbox_error",
)
"""Every value ``SandboxResult.status`` can take.

ok: exit code 0. error: non-zero exit (the reason is the last stderr line, e.g. an uncaught
exception or ``BlockingIOError`` from the process limit). timeout: the wall-clock or CPU limit
was hit. memory: ``MemoryError`` (or a crash) under the address-space limit. output_limit:
stdout + stderr exceeded ``max_output_bytes``. killed: ended by a signal. tampered: the program
ran and then ended or spoke for the sandbox around it (killed its launcher or init, wrote into
their report channel): the program's doing, scored like any failure. sandbox_error: the sandbox
itself could not run the program (it never started); only this status is not the program's
fault."""

# Linux constants (include/uapi/linux/sched.h, mount.h, prctl.h).
_CLONE_NEWNS = 0x00020000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_NOEXEC = 8
_MS_REMOUNT = 32
_MS_NOATIME = 1024
_MS_NODIRATIME = 2048
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_MS_RELATIME = 1 << 21
_MS_STRICTATIME = 1 << 24
_PR_SET_PDEATHSIG = 1
_SIGKILL = 9  # the launcher avoids importing `signal` (and with it `enum`): start-up time
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_DUMPABLE = 4
_CLONE_NEWUSER = 0x10000000
_MOUNT_OPT_FLAGS = {
    "nosuid": _MS_NOSUID,
    "nodev": _MS_NODEV,
    "noexec": _MS_NOEXEC,
    "noatime": _MS_NOATIME,
    "nodiratime": _MS_NODIRATIME,
    "relatime": _MS_RELATIME,
    "strictatime": _MS_STRICTATIME,
}


# --------------------------------------------------------------------------------------------
# Launcher side: runs in the child interpreter (``python -I -S this_file config``), as root.
# --------------------------------------------------------------------------------------------


def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(libc, source, target: str, fstype, flags: int, data) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _unescape(field: str) -> str:
    """Undo mountinfo's octal escapes (``\\040`` = space). Not the ``unicode_escape`` codec: a
    launcher that dropped its uid may no longer reach the codec's module."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _mountinfo_points() -> list[tuple[str, int]]:
    """(mount point, per-mount flags) of every mount, in /proc/self/mountinfo order."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = _unescape(fields[4])
            flags = 0
            for opt in fields[5].split(","):
                flags |= _MOUNT_OPT_FLAGS.get(opt, 0)
            out.append((point, flags))
    return out


def _blocked_ancestors(paths: list[str]) -> dict[str, list[str]]:
    """{first ancestor that others cannot traverse: [paths below it]} for the given paths."""
    blocked: dict[str, list[str]] = {}
    for p in paths:
        cur = ""
        for comp in p.strip("/").split("/"):
            cur = f"{cur}/{comp}"
            if not os.stat(cur).st_mode & 0o001:
                blocked.setdefault(cur, []).append(p)
                break
    return blocked


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _hide(libc, hide: list[str], expose: list[str]) -> list[str]:
    """Cover directories with an empty tmpfs, bind-mounting the interpreter's back into them.

    Covered: each existing directory of ``hide`` that does not lie inside an ``expose`` path, and
    each ancestor of an ``expose`` path that others cannot traverse (``/root`` holding pyenv);
    only the outermost of nested ones. Every ``expose`` path under a cover is bind-mounted back,
    so the interpreter still starts and everything else there becomes invisible. Returns the
    covered directories.
    """
    wanted = [d for d in hide if os.path.isdir(d) and not any(_inside(d, p) for p in expose)]
    wanted += list(_blocked_ancestors(expose))
    covers = sorted({d for d in wanted if d != "/"})
    covers = [d for d in covers if not any(_inside(d, o) and d != o for o in covers)]
    for cover in covers:
        inner = [p for p in expose if _inside(p, cover)]
        try:
            fds = {p: os.open(p, os.O_PATH) for p in inner}  # keep the real dirs reachable
        except PermissionError:
            raise OSError(
                13,
                f"the interpreter ({', '.join(inner)}) lies under {cover}, which uid "
                f"{os.geteuid()} cannot traverse: install Python where other users can read it, "
                "or run the trainer as root with CAP_SYS_ADMIN",
            ) from None
        _mount(libc, "tmpfs", cover, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=64k")
        for p, fd in fds.items():
            if p != cover:
                os.makedirs(p, exist_ok=True)
            _mount(libc, f"/proc/self/fd/{fd}", p, None, _MS_BIND | _MS_REC, None)
            os.close(fd)
    return covers


def _write_map(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _enter_user_namespace(libc, uid: int, flags: int) -> tuple[int, int]:
    """Unshare a user namespace together with ``flags``; returns the program's (uid, gid).

    Root (here without CAP_SYS_ADMIN, or the ``root`` mechanism would have been used) first
    becomes the per-program ``uid``, so the program never runs as host uid 0. The namespace
    maps just that one id onto itself (all an unprivileged process may map); the launcher holds
    every capability inside it until the program's ``execve``, which, as a non-zero uid, drops
    them all.
    """
    if os.geteuid() == 0:
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        except OSError as exc:
            raise OSError(
                exc.errno, f"root without CAP_SETUID cannot switch to an unprivileged uid ({exc})"
            ) from None
        # setuid made us non-dumpable, which makes /proc/self/uid_map root-owned (unwritable).
        _check(libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0), "prctl(DUMPABLE)")
    uid, gid = os.geteuid(), os.getegid()
    _check(libc.unshare(_CLONE_NEWUSER | flags), "unshare(user, mount, PID, IPC, UTS, network)")
    _write_map("/proc/self/setgroups", "deny")
    _write_map("/proc/self/uid_map", f"{uid} {uid} 1")
    _write_map("/proc/self/gid_map", f"{gid} {gid} 1")
    return uid, gid


def _read_workdir(workdir: str) -> dict[str, bytes]:
    """The work directory's files by name, read into memory."""
    files = {}
    for name in os.listdir(workdir):
        with open(os.path.join(workdir, name), "rb") as f:
            files[name] = f.read()
    return files


def _unshare(libc, cfg: dict) -> tuple[int | None, int, int]:
    """Enter the mount, PID, IPC, UTS (and network) namespaces under ``cfg``'s mechanism;
    returns (the uid the program's process still has to switch to or None, its uid, its gid)."""
    mech = cfg["mechanism"]
    flags = _CLONE_NEWNS | _CLONE_NEWIPC | _CLONE_NEWUTS | _CLONE_NEWPID
    if cfg["network_namespace"]:
        flags |= _CLONE_NEWNET
    if mech == "root":
        if os.geteuid() != 0:
            raise OSError(1, "the 'root' mechanism needs root")
        _check(libc.unshare(flags), "unshare(mount, PID, IPC, UTS, network)")
        setuid_to, uid, gid = cfg["uid"], cfg["uid"], cfg["uid"]
    elif mech == "userns":
        uid, gid = _enter_user_namespace(libc, cfg["uid"], flags)
        setuid_to = None  # already the program's uid; execve drops the capabilities
    else:
        raise OSError(22, f"unknown mechanism {mech!r}")
    return setuid_to, uid, gid


def _remount_read_only(libc) -> None:
    """Remount every mount read-only and nosuid; raise (fail closed) if any stays writable."""
    ro_failed = []
    for point, mflags in _mountinfo_points():
        try:
            _mount(
                libc,
                None,
                point,
                None,
                _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | mflags,
                None,
            )
        except OSError:
            ro_failed.append(point)
    if ro_failed:  # fail closed: a writable mount is a way out
        raise OSError(30, f"could not make these mounts read-only: {ro_failed}")


def _fill_workdir(libc, cfg: dict, files: dict[str, bytes], uid: int, gid: int) -> None:
    """Mount the size-capped tmpfs owned by the program over the work directory and write
    ``files`` back into it."""
    workdir = cfg["workdir"]
    data = f"size={int(cfg['disk_mb'])}m,mode=0700,uid={uid},gid={gid}"
    _mount(libc, "tmpfs", workdir, "tmpfs", _MS_NOSUID | _MS_NODEV, data)
    for name, content in files.items():
        path = os.path.join(workdir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, content)
        os.close(fd)
        if cfg["mechanism"] == "root":
            os.chown(path, uid, gid)


def _init_main(libc, cfg: dict, setuid_to, send) -> None:
    """PID 1 of the new namespace: a minimal init that mounts a /proc showing only the
    namespace, runs the program as PID 2 and reaps orphans. Never returns."""
    # The program is not PID 1 because the kernel ignores default-action signals (SIGXCPU,
    # SIGABRT) sent to PID 1.
    try:
        _check(libc.prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
        # A session of its own (after PDEATHSIG: until now the launcher's group kill reached
        # us): a program that signals its process group (kill(0), killpg) reaches only the
        # init, which ignores it, and itself, never the launcher outside the namespace.
        os.setsid()
        _mount(libc, "proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None)
        _spawn_and_wait(libc, cfg, setuid_to, send, report_pid=False)
    except BaseException as exc:  # noqa: BLE001 - anything here is a setup failure
        send({"setup_error": f"init: {type(exc).__name__}: {exc}"})
        os._exit(127)
    os._exit(0)  # every other process in the namespace is killed with us


def _launcher_main(config_hex: str) -> None:
    """Build the sandbox ``config_hex`` describes, run the program in it, and report on the
    pipe. Never returns."""
    # marshal, not json: it is built in, and importing json (re, enum) costs ~15 ms per program.
    cfg = marshal.loads(bytes.fromhex(config_hex))
    report = cfg["report_fd"]

    def send(obj) -> None:
        os.write(report, marshal.dumps(obj).hex().encode() + b"\n")

    libc = _libc()
    import resource  # noqa: F401 - now: after a uid switch the stdlib may be out of reach

    mech = cfg["mechanism"]
    workdir = cfg["workdir"]
    enforced: dict[str, object] = {"mechanism": mech}
    if mech == "none":
        enforced["unprivileged_uid"] = False
        send({"enforced": enforced})
        _spawn_and_wait(libc, cfg, None, send, report_pid=True)
        os._exit(0)
    try:
        # read now: the work directory's parent (/tmp) is about to be covered
        files = _read_workdir(workdir)
        setuid_to, uid, gid = _unshare(libc, cfg)
        enforced.update(
            user_namespace=mech == "userns",
            network_namespace=bool(cfg["network_namespace"]),
            mount_namespace=True,
            pid_namespace=True,
        )
        _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE, None)
        enforced["hidden_dirs"] = _hide(libc, cfg["hide"], cfg["expose"])
        os.makedirs(workdir, exist_ok=True)  # inside a cover now: an empty mount point
        _remount_read_only(libc)
        enforced["read_only_root"] = True
        _fill_workdir(libc, cfg, files, uid, gid)
        enforced["tmpfs_workdir_mb"] = int(cfg["disk_mb"])
        enforced["unprivileged_uid"] = True
    except OSError as exc:
        send({"enforced": enforced, "setup_error": f"{mech} sandbox: {exc}"})
        os._exit(127)
    send({"enforced": enforced})

    pid = os.fork()
    if pid == 0:
        _init_main(libc, cfg, setuid_to, send)  # never returns
    # Launcher: stay outside the PID namespace; killing `pid` (the init) ends the namespace.
    send({"child_pid": pid})
    _, status = os.waitpid(pid, 0)
    # If the init dies before the program's report (it should not: signals from inside the
    # namespace do not reach it), say how, so the supervisor can tell who ended it.
    send({"init_status": status})
    os._exit(0)


def _spawn_and_wait(libc, cfg: dict, setuid_to, send, report_pid: bool) -> None:
    """Fork the program, report when its ``execve`` succeeded, reap every child until the
    program exits, and report its wait status."""
    # Close-on-exec pipe (os.pipe's default): EOF with no byte means the exec happened. From
    # then on the program has run, and whatever ends the sandbox is no longer a setup failure.
    exec_r, exec_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(exec_r)
        try:
            _child_exec(libc, cfg, setuid_to)
        except BaseException as exc:  # noqa: BLE001 - anything here is a setup failure
            send({"setup_error": f"child: {type(exc).__name__}: {exc}"})
            os.write(exec_w, b"x")
        os._exit(127)
    os.close(exec_w)
    if report_pid:
        send({"child_pid": pid})
    if os.read(exec_r, 1) == b"":
        send({"exec": True})
    os.close(exec_r)
    while True:
        done, status, usage = os.wait4(-1, 0)
        if done == pid:
            break
    send({"wait_status": status, "cpu_s": usage.ru_utime + usage.ru_stime})


def _child_exec(libc, cfg: dict, setuid_to) -> None:
    import resource

    workdir = cfg["workdir"]
    lim = cfg["limits"]
    cpu = int(lim["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    mem = int(lim["memory_mb"]) * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    fsize = int(lim["fsize_mb"]) * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(lim["nofile"]), int(lim["nofile"])))
    nproc = int(lim["nproc"])
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    os.chdir(workdir)
    if setuid_to is not None:
        os.setgroups([])
        os.setgid(setuid_to)
        os.setuid(setuid_to)
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    # After setuid (which clears it): die with the launcher, which dies with the supervisor.
    _check(libc.prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    os.set_inheritable(cfg["report_fd"], False)  # closed by exec; still usable if exec fails
    argv = [cfg["python"], "-I", "main.py", *cfg["args"]]
    os.execve(cfg["python"], argv, cfg["env"])


if __name__ == "__main__":
    _launcher_main(sys.argv[1])  # never returns


# --------------------------------------------------------------------------------------------
# Supervisor side.
# --------------------------------------------------------------------------------------------

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import secrets  # noqa: E402
import selectors  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterable, Sequence  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

from peergrade.errors import PeergradeError  # noqa: E402


@dataclasses.dataclass
class SandboxResult:
    """The outcome of one program. ``status`` is one of ``STATUSES``; ``reason`` says why in words
    (empty when ``ok``); ``returncode`` is the exit code, or ``-signal`` when ended by a signal,
    or None when it never ran; ``enforced`` records which isolation measures were in force."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    reason: str
    wall_s: float
    enforced: dict = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """The limits ``run_program`` runs a program under; checked when built.

    timeout_s: wall clock, from launch to exit (seconds). cpu_time_s: RLIMIT_CPU per process
    (None: ``timeout_s`` rounded up). memory_mb: RLIMIT_AS per process. max_processes:
    RLIMIT_NPROC for the program's uid (the program itself counts). max_output_bytes: cap on
    stdout + stderr together. disk_mb: size of the tmpfs work directory (and the RLIMIT_FSIZE
    of any one file). max_open_files: RLIMIT_NOFILE.
    """

    timeout_s: float = 5.0
    cpu_time_s: float | None = None
    memory_mb: int = 512
    max_processes: int = 16
    max_output_bytes: int = 64_000
    disk_mb: int = 64
    max_open_files: int = 64

    def __post_init__(self) -> None:
        if (
            self.timeout_s <= 0
            or self.memory_mb <= 0
            or self.max_processes <= 0
            or self.max_output_bytes <= 0
        ):
            raise ValueError(
                "run_program: timeout_s, memory_mb, max_processes and max_output_bytes must be > 0"
            )
        cpu = self.cpu_time_s
        if self.disk_mb <= 0 or self.max_open_files <= 0 or (cpu is not None and cpu <= 0):
            # a tmpfs of size 0 would be unlimited: refuse it rather than lift the cap
            raise ValueError(
                "run_program: disk_mb, max_open_files and cpu_time_s (when given) must be > 0, "
                f"got {self.disk_mb}, {self.max_open_files}, {cpu}"
            )

    @property
    def cpu_s(self) -> int:
        """RLIMIT_CPU in whole seconds: ``cpu_time_s`` (else ``timeout_s``) rounded up, >= 1."""
        limit = self.cpu_time_s if self.cpu_time_s is not None else self.timeout_s
        return max(1, int(-(-limit // 1)))


#: the limits of the probes ``select_mechanism`` and ``self_test`` run
_PROBE_LIMITS = SandboxLimits(timeout_s=20.0, memory_mb=512)


# One uid per running program so that RLIMIT_NPROC counts only that program's processes and
# programs cannot signal each other. The base depends on our pid so that two trainers on one
# machine are unlikely to share uids; 1000 concurrent programs per process at most.
_UID_BASE = 1_000_000_000 + (os.getpid() % 100_000) * 1000
_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()


def _acquire_uid() -> int:
    with _uid_lock:
        for i in range(1000):
            if _UID_BASE + i not in _uids_in_use:
                _uids_in_use.add(_UID_BASE + i)
                return _UID_BASE + i
    raise RuntimeError("more than 1000 sandboxed programs running at once in one process")


def _release_uid(uid: int) -> None:
    with _uid_lock:
        _uids_in_use.discard(uid)


_prefix_cache: dict[str, list[str]] = {}


def _python_dirs(python: str) -> list[str]:
    """Real directories the interpreter needs to start (its prefixes and its binary's dir)."""
    if python not in _prefix_cache:
        if os.path.realpath(python) == os.path.realpath(sys.executable):
            prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
        else:
            code = "import sys,json;print(json.dumps([sys.prefix,sys.base_prefix]))"
            out = subprocess.run(
                [python, "-I", "-c", code], capture_output=True, text=True, timeout=30, check=True
            )
            prefixes = json.loads(out.stdout)
        dirs = {os.path.realpath(p) for p in prefixes}
        dirs.add(os.path.dirname(os.path.realpath(python)))
        # Only the outermost of nested directories (binding a parent brings its children).
        keep = sorted(d for d in dirs if not any(d.startswith(o + "/") for o in dirs if o != d))
        _prefix_cache[python] = keep
    return _prefix_cache[python]


MECHANISMS = ("auto", "root", "userns", "none")
"""``run_program``'s ``mechanism`` values; see ``select_mechanism`` for the order ``auto`` tries."""

_FIX = (
    "Fix: enable unprivileged user namespaces (`sysctl -w user.max_user_namespaces=15000`, and "
    "`kernel.unprivileged_userns_clone=1` where that sysctl exists; in Docker or Podman allow "
    "them, e.g. `--security-opt seccomp=unconfined --security-opt apparmor=unconfined`), or run "
    "the trainer as root with CAP_SYS_ADMIN; or, for trusted code only, give the code reward "
    "`sandbox: none` to run programs unsandboxed"
)


class SandboxUnavailable(PeergradeError, RuntimeError):
    """The sandbox cannot contain untrusted programs here (``require_sandbox``): says what is
    missing and how to fix it. ``score_rewards`` re-raises it whatever ``on_reward_error``
    says (``stops_run``): training must not go on with a reward that cannot run."""

    stops_run = True


def _hidden_dirs() -> list[str]:
    """Directories covered by an empty tmpfs inside the sandbox: homes (the trainer's
    ``$HOME`` included), temp directories (the trainer's files, other programs' work dirs),
    and ``/run`` (sockets such as docker.sock or D-Bus, reachable even with no network)."""
    dirs = ["/root", "/home", "/tmp", "/var/tmp", "/dev/shm", "/run", tempfile.gettempdir()]
    for home in (os.environ.get("HOME"), os.path.expanduser("~")):
        if home:
            dirs.append(home)
    return sorted({os.path.realpath(d) for d in dirs} - {"/"})


def _has_capability(bit: int) -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> bit & 1)
    except OSError:
        pass
    return False


_CAP_SYS_ADMIN = 21
_CAPS_TO_SWITCH_UID = (0, 6, 7)  # CAP_CHOWN, CAP_SETGID, CAP_SETUID
_select_lock = threading.Lock()
_selected: dict[tuple, tuple[str | None, dict[str, str]]] = {}


def select_mechanism(
    python: str = sys.executable, *, network: bool = False
) -> tuple[str | None, dict[str, str]]:
    """The isolation mechanism ``auto`` uses here, and why each earlier candidate was refused.

    Tried in order, the first under which a probe program runs isolated wins (cached per
    process): ``root`` (we are root with CAP_SYS_ADMIN: namespaces directly, a per-program host
    uid), then ``userns`` (an unprivileged user namespace; root without CAP_SYS_ADMIN first
    switches to the per-program uid). ``(None, reasons)`` when none works: the caller fails
    closed. ``none`` is never chosen automatically.
    """
    key = (python, network)
    with _select_lock:
        if key not in _selected:
            failures: dict[str, str] = {}
            chosen = None
            candidates = []
            if os.geteuid() != 0:
                failures["root"] = "not root"
            elif not _has_capability(_CAP_SYS_ADMIN):
                failures["root"] = "root without CAP_SYS_ADMIN"
            else:
                candidates.append("root")
            if os.geteuid() == 0 and not all(map(_has_capability, _CAPS_TO_SWITCH_UID)):
                # A user namespace may not map host uid 0 without CAP_SETFCAP, and the program
                # must not run as host uid 0 anyway: root has to switch it to another uid.
                failures["userns"] = (
                    "root without CAP_SETUID, CAP_SETGID and CAP_CHOWN cannot give programs "
                    "an unprivileged uid (run the trainer as an ordinary user instead)"
                )
            else:
                candidates.append("userns")
            for mech in candidates:
                res = run_program(
                    "print('peergrade-probe')",
                    limits=_PROBE_LIMITS,
                    mechanism=mech,
                    python=python,
                    network=network,
                )
                if res.ok and res.stdout.strip() == "peergrade-probe":
                    chosen = mech
                    break
                failures[mech] = res.reason or res.status
            _selected[key] = (chosen, failures)
        return _selected[key]


def _unavailable(failures: dict[str, str]) -> str:
    tried = "; ".join(f"{m}: {why}" for m, why in failures.items())
    return f"no sandbox mechanism can isolate programs here ({tried}). {_FIX}"


_CANARY = r"""
import hashlib, json, os, socket, sys
cfg = json.loads(sys.argv[1])
wanted = set(cfg["env"])
found = {"wrote": [], "read": [], "env_hits": 0}
for path in cfg["write"]:
    try:
        with open(path, "w") as f:
            f.write("escaped")
        found["wrote"].append(path)
    except OSError:
        pass
for path in cfg["read"]:
    try:
        with open(path, "rb") as f:
            found["read"].append(f.read(4096).decode("latin-1"))
    except OSError:
        pass
pids = [n for n in os.listdir("/proc") if n.isdigit()]
for pid in pids:
    if int(pid) != os.getpid():
        try:
            with open("/proc/%s/environ" % pid, "rb") as f:
                for entry in f.read().split(b"\0"):
                    if hashlib.sha256(entry).hexdigest()[:32] in wanted:
                        found["env_hits"] += 1
        except OSError:
            pass
try:
    with open("/proc/%d/stat" % cfg["pid"]) as f:
        stat = f.read()
    found["sees_trainer"] = stat[stat.rindex(")") + 2:].split()[19] == cfg["start"]
except (OSError, IndexError, ValueError):
    found["sees_trainer"] = False
found["pids"] = len(pids)
if cfg["port"]:
    try:
        socket.create_connection(("127.0.0.1", cfg["port"]), timeout=1).close()
        found["connected"] = True
    except OSError:
        found["connected"] = False
    found["interfaces"] = [name for _, name in socket.if_nameindex()]
print(json.dumps(found))
"""


def _canary_files(token: str) -> tuple[list[str], list[str], str]:
    """Plant the canary's bait: (paths it must not manage to write, the files we created that it
    must not read, the secret file in ``$HOME``)."""
    created: list[str] = []
    targets = []
    for d in {os.path.expanduser("~"), tempfile.gettempdir(), "/dev/shm", "/var/tmp", os.getcwd()}:
        if os.path.isdir(d) and os.access(d, os.W_OK):
            targets.append(os.path.join(d, f".peergrade-canary-w-{token}"))
    home_secret = os.path.join(os.path.expanduser("~"), f".peergrade-canary-{token}")
    try:
        fd = os.open(home_secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, token.encode())
        os.close(fd)
        created.append(home_secret)
    except OSError:
        pass  # an unwritable $HOME holds nothing we put there; the other checks still run
    return targets, created, home_secret


def _local_listener():
    """A listening socket on 127.0.0.1 that the canary must not reach, and its port."""
    import socket

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.05)
    return listener, listener.getsockname()[1]


def _canary_config(targets: list[str], created: list[str], stat: str, port: int) -> dict:
    """What the canary is told to try: the paths to write and read, hashes of this process's
    environment, this process's pid and start time (from ``stat``), and the listener's port."""
    import hashlib

    with open("/proc/self/environ", "rb") as f:  # what this process started with
        ours = {e for e in f.read().split(b"\0") if e}
    ours -= {b"PATH=/usr/local/bin:/usr/bin:/bin", b"LANG=C.UTF-8"}  # what the sandbox sets
    return {
        # hashed: the canary looks for our environment without being handed it
        "env": [hashlib.sha256(e).hexdigest()[:32] for e in ours],
        "write": targets,
        "read": created,
        "pid": os.getpid(),
        "start": stat[stat.rindex(")") + 2 :].split()[19],
        "port": port,
    }


def _add_canary_escapes(
    escapes: list[str], found: dict, token: str, home_secret: str, network: bool
) -> None:
    """Append to ``escapes`` what the canary's own report (``found``) shows it managed."""
    if any(token in text for text in found["read"]):
        escapes.append(f"read a secret file in $HOME ({home_secret})")
    if found["env_hits"]:
        escapes.append("read this process's environment through /proc/<pid>/environ")
    if found["sees_trainer"]:
        escapes.append(f"see this process (pid {os.getpid()}) in /proc")
    if not network:
        if found.get("connected") and not any("network" in e for e in escapes):
            escapes.append("connect to a listener on 127.0.0.1")
        others = [n for n in found.get("interfaces", []) if n != "lo"]
        if others:
            escapes.append(f"see the host's network interfaces ({', '.join(others)})")


def self_test(
    python: str = sys.executable, *, mechanism: str = "auto", network: bool = False
) -> dict:
    """Run a canary that tries to escape; report what it managed.

    The canary tries to write into ``$HOME``, the temp directory, ``/dev/shm``, ``/var/tmp``
    and the current directory; to read a secret file placed in ``$HOME``; to read every visible
    process's environment (looking for this process's variables); to see this process in
    ``/proc``; and (unless ``network``) to connect to a listener of this process on 127.0.0.1
    and to see any network interface but ``lo``. Returns ``{"mechanism", "escapes": [what it
    did], "error": why it could not run or None, "enforced"}``; contained when both are empty.
    """
    if mechanism == "auto":
        chosen, failures = select_mechanism(python, network=network)
        if chosen is None:
            return {"mechanism": None, "escapes": [], "error": _unavailable(failures)}
        mechanism = chosen
    token = secrets.token_hex(16)
    targets, created, home_secret = _canary_files(token)
    with open("/proc/self/stat") as f:
        stat = f.read()
    listener, port = (None, 0) if network else _local_listener()
    cfg = _canary_config(targets, created, stat, port)
    escapes: list[str] = []
    try:
        res = run_program(
            _CANARY,
            args=[json.dumps(cfg)],
            limits=_PROBE_LIMITS,
            mechanism=mechanism,
            python=python,
            network=network,
        )
        written = [t for t in targets if os.path.exists(t)]
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.accept()[0].close()
                escapes.append("connect to this process over the network (127.0.0.1)")
    finally:
        for path in created + targets:
            with contextlib.suppress(OSError):
                os.remove(path)
        if listener is not None:
            listener.close()
    out = {"mechanism": mechanism, "escapes": escapes, "error": None, "enforced": res.enforced}
    if written:
        escapes.append(f"write outside its directory ({', '.join(written)})")
    try:
        found = json.loads(res.stdout.strip().splitlines()[-1]) if res.ok else None
    except (ValueError, IndexError):
        found = None
    if found is None:
        out["error"] = f"the self-test canary did not run: {res.status}: {res.reason}"
        return out
    _add_canary_escapes(escapes, found, token, home_secret, network)
    return out


# (mechanism, python, network) -> the mechanism that passed, or the error to raise again
_required: dict[tuple, str | SandboxUnavailable] = {}


def require_sandbox(
    mechanism: str = "auto", python: str = sys.executable, *, network: bool = False
) -> str:
    """Fail closed: the mechanism that contained the self-test canary, or SandboxUnavailable.

    ``mechanism="none"`` (the explicit opt-out) runs no test and prints a warning on stderr
    every time it is asked for. The outcome, pass or fail, is cached per process.
    """
    if mechanism not in MECHANISMS:
        raise ValueError(f"sandbox must be one of {MECHANISMS}, got {mechanism!r}")
    if mechanism == "none":
        print(
            "warning: the code reward runs model-written programs UNSANDBOXED (sandbox: none): "
            "they can read and write your files, use the network and signal your processes",
            file=sys.stderr,
            flush=True,
        )
        return "none"
    key = (mechanism, python, network)
    if key not in _required:
        report = self_test(python, mechanism=mechanism, network=network)
        where = f"the code sandbox ({report['mechanism'] or mechanism})"
        if report["error"]:
            _required[key] = SandboxUnavailable(
                f"{where} failed its self-test: {report['error']}"
                + ("" if _FIX in report["error"] else f". {_FIX}")
            )
        elif report["escapes"]:
            _required[key] = SandboxUnavailable(
                f"{where} did not contain its self-test canary, which could: "
                f"{'; '.join(report['escapes'])}. {_FIX}"
            )
        else:
            _required[key] = report["mechanism"]
    if isinstance(_required[key], SandboxUnavailable):
        raise _required[key]
    return _required[key]


def _uid_processes(uid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid and not _is_zombie(name):
                    pids.append(int(name))
            except OSError:
                pass
    return pids


def _is_zombie(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True  # gone
    return stat[stat.rindex(b")") + 2 :].startswith(b"Z")


def _group_processes(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(b")") + 2 :].split()  # after "pid (comm) "
            if fields[0] != b"Z" and int(fields[2]) == pgid:
                pids.append(int(name))
    return pids


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _last_line(text: str, limit: int = 300) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:limit] if lines else ""


def _checked_files(code, files, limits) -> dict[str, str]:
    """``files`` as a dict, after raising ValueError for a program that is not a str, limits
    that are not a ``SandboxLimits``, or a file name that is not a plain name other than
    main.py."""
    if not isinstance(code, str):
        raise ValueError(f"run_program: code must be a str, got {type(code).__name__}")
    if not isinstance(limits, SandboxLimits):
        raise ValueError(
            f"run_program: limits must be a SandboxLimits, got {type(limits).__name__}"
        )
    files = dict(files or {})
    for name in files:
        if not isinstance(name, str) or not name or "/" in name or name in (".", "..", "main.py"):
            raise ValueError(f"run_program: bad file name {name!r} (a plain name, not main.py)")
    return files


def _program_env(workdir: str) -> dict[str, str]:
    """The program's whole environment: nothing of ours is inherited."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
    }


def _write_program(workdir: str, files: dict[str, str]) -> None:
    """Write the program's files (``main.py`` among them) into the work directory, mode 0644."""
    for name, content in files.items():
        with open(os.path.join(workdir, name), "w", encoding="utf-8") as f:
            f.write(content)
        os.chmod(os.path.join(workdir, name), 0o644)


def _give_workdir(workdir: str, uid: int) -> None:
    """Make the program's uid the owner of the work directory and its files."""
    for name in os.listdir(workdir):
        os.chown(os.path.join(workdir, name), uid, uid)
    os.chown(workdir, uid, uid)


def _nproc_limit(max_processes: int, mechanism: str, own_uid: bool) -> int:
    """RLIMIT_NPROC that leaves the program ``max_processes`` processes of its own."""
    nproc = max_processes
    if mechanism == "userns":
        # Since Linux 5.14 RLIMIT_NPROC counts per user namespace and uid: the program's
        # processes plus the launcher and the init, which share its namespace and uid.
        nproc += 2
    elif not own_uid:
        # RLIMIT_NPROC counts every process of our uid: allow what already runs.
        nproc += len(_uid_processes(os.getuid()))
    return nproc


def _launcher_config(
    workdir, uid, mechanism, python, args, *, network, disk_mb, cpu_s, memory_mb, nofile, nproc
) -> dict:
    """What the launcher needs to build the sandbox and start the program under its limits
    (all but the report pipe's fd)."""
    return {
        "workdir": workdir,
        "uid": uid,
        "mechanism": mechanism,
        "python": python,
        "args": [str(a) for a in args],
        "env": _program_env(workdir),
        "disk_mb": disk_mb,
        "network_namespace": not network,
        "expose": _python_dirs(python) if mechanism != "none" else [],
        "hide": _hidden_dirs() if mechanism != "none" else [],
        "limits": {
            "cpu_s": cpu_s,
            "memory_mb": memory_mb,
            "fsize_mb": disk_mb,
            "nofile": nofile,
            "nproc": nproc,
        },
    }


def _start_launcher(cfg: dict, stdin: str) -> subprocess.Popen:
    """Start this file as the launcher (``python -I -S``) in a new session, with ``stdin`` as
    the program's input and only the report pipe passed on."""
    with tempfile.TemporaryFile() as stdin_file:
        stdin_file.write(stdin.encode("utf-8"))
        stdin_file.seek(0)
        return subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), marshal.dumps(cfg).hex()],
            stdin=stdin_file,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(cfg["report_fd"],),
            start_new_session=True,
            env={"PATH": cfg["env"]["PATH"], "LANG": "C.UTF-8"},
            cwd="/",
        )


def run_program(
    code: str,
    *,
    stdin: str = "",
    args: Sequence[str] = (),
    files: dict[str, str] | None = None,
    limits: SandboxLimits | None = None,
    python: str = sys.executable,
    network: bool = False,
    isolate: bool = True,
    mechanism: str = "auto",
) -> SandboxResult:
    """Run ``code`` as ``python -I main.py *args`` with ``stdin`` as its input, under ``limits``
    (``SandboxLimits``: wall clock, CPU time, memory, processes, output, disk, open files;
    None: its defaults, 5 s and 512 MB).

    files: extra text files written next to ``main.py`` in the work directory, owned by the
    program (it may read, change or delete them). network=True keeps the host network (no
    network namespace). mechanism: ``"auto"`` (the first of ``select_mechanism``'s candidates
    that works here; when none does, every program ends ``sandbox_error`` without running),
    ``"root"``, ``"userns"`` (force one), or ``"none"``: no namespaces and no uid switch
    (rlimits, new session and group kill only; NOT a security boundary). ``isolate=False`` is
    the older spelling of ``mechanism="none"``.
    Never raises for anything the program does; bad arguments raise ValueError.
    """
    if mechanism not in MECHANISMS:
        raise ValueError(f"run_program: mechanism must be one of {MECHANISMS}, got {mechanism!r}")
    if not isolate:
        mechanism = "none"
    lim = limits if limits is not None else SandboxLimits()
    files = _checked_files(code, files, lim)
    cpu_s = lim.cpu_s
    t0 = time.monotonic()
    if mechanism == "auto":
        try:
            mechanism, failures = select_mechanism(python, network=network)
        except OSError as exc:
            return SandboxResult("sandbox_error", None, "", "", f"supervisor: {exc}", 0.0)
        if mechanism is None:
            return SandboxResult("sandbox_error", None, "", "", _unavailable(failures), 0.0)
    uid = _acquire_uid()
    workdir = tempfile.mkdtemp(prefix="peergrade-sbx-")
    proc = None
    report_r = report_w = -1
    try:
        _write_program(workdir, {**files, "main.py": code})
        # A per-program host uid wherever we can switch to one (root, even without CAP_SYS_ADMIN).
        own_uid = os.geteuid() == 0 and mechanism != "none"
        if own_uid:
            _give_workdir(workdir, uid)
        nproc = _nproc_limit(lim.max_processes, mechanism, own_uid)
        cfg = _launcher_config(
            workdir,
            uid,
            mechanism,
            python,
            args,
            network=network,
            disk_mb=lim.disk_mb,
            cpu_s=cpu_s,
            memory_mb=lim.memory_mb,
            nofile=lim.max_open_files,
            nproc=nproc,
        )
        report_r, report_w = os.pipe()
        cfg["report_fd"] = report_w
        proc = _start_launcher(cfg, stdin)
        os.close(report_w)
        report_w = -1
        return _supervise(
            proc, report_r, uid if own_uid else None, t0, lim.timeout_s, cpu_s, lim.max_output_bytes
        )
    except OSError as exc:
        return SandboxResult("sandbox_error", None, "", "", f"supervisor: {exc}", 0.0)
    finally:
        if proc is not None:
            _kill_all(proc, uid if own_uid else None)
        for fd in (report_r, report_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
        _release_uid(uid)


def _kill_all(proc: subprocess.Popen, uid: int | None, child_pid: int | None = None) -> None:
    """Kill the program, the launcher's process group, and anything left with the sandbox uid.

    The program (PID 1 of its namespace) is killed first so that the launcher, its parent, reaps
    it: killing the launcher first would leave it a zombie for the host's init to reap.
    """
    if child_pid and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child_pid, signal.SIGKILL)  # the launcher has not reaped it: pid still ours
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=2.0)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # Only non-empty without a PID namespace (fallback mode): wait until the kills took effect.
    for _ in range(200):
        pids = _group_processes(proc.pid)
        if uid is not None and os.geteuid() == 0:
            pids += _uid_processes(uid)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _parse_report(report: bytes) -> dict:
    """The launcher's report lines merged into one dict. A setup error that arrives after the
    program's exec cannot be the sandbox's (setup is over by then): it is kept as ``forged``."""
    info: dict = {}
    for line in report.decode("ascii", "replace").splitlines():
        with contextlib.suppress(ValueError, EOFError, TypeError, AttributeError):
            entry = dict(marshal.loads(bytes.fromhex(line)))
            if info.get("exec") and "setup_error" in entry:
                info.setdefault("forged", entry.pop("setup_error"))
            info.update(entry)
    return info


def _read_until_done(proc, report_r: int, deadline: float, max_output_bytes: int):
    """Read the program's stdout and stderr and the launcher's report until all three close,
    the deadline passes or the output exceeds its cap: (bufs by fd, report, over_output,
    timed_out)."""
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    report = bytearray()
    sel = selectors.DefaultSelector()
    for fd in (*bufs, report_r):
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    over_output = timed_out = False
    open_fds = 3
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for key, _ in sel.select(timeout=min(left, 0.5)):
            fd = key.fd
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                sel.unregister(fd)
                open_fds -= 1
            elif fd == report_r:
                report += chunk
            else:
                bufs[fd] += chunk
        if sum(len(b) for b in bufs.values()) > max_output_bytes:
            over_output = True
            break
    sel.close()
    return bufs, report, over_output, timed_out


def _unreported_end(info: dict, proc) -> tuple[str, int | None, str]:
    """(status, rc, reason) when the launcher ended without the program's wait status."""
    if not info.get("exec"):
        return (
            "sandbox_error",
            None,
            f"launcher ended without a report before the program started (rc {proc.returncode})",
        )
    # The program ran and its sandbox ended before reporting on it, and not by our hand (a
    # timeout or the output cap would have been handled above): the program did it.
    init = info.get("init_status")
    if init is not None and os.WIFSIGNALED(init):
        what = f"the sandbox's init (killed by {_signal_name(os.WTERMSIG(init))})"
    elif proc.returncode is not None and proc.returncode < 0:
        what = f"its launcher (killed by {_signal_name(-proc.returncode)})"
    else:
        what = f"its launcher (exit code {proc.returncode})"
    return (
        "tampered",
        proc.returncode,
        f"the program ended {what} while it ran, e.g. by signalling its parent or its "
        "process group",
    )


def _program_end(info: dict, cpu_s: int, stderr: str) -> tuple[str, int | None, str]:
    """(status, rc, reason) from the program's reported wait status."""
    status = info["wait_status"]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and info.get("cpu_s", 0) >= cpu_s):
            return "timeout", -sig, f"CPU time limit of {cpu_s} s exceeded ({_signal_name(sig)})"
        if sig == signal.SIGKILL:
            # The sandbox sends SIGKILL only at a limit (handled above): this one came from the
            # program itself (os.kill, killpg of its own group) or the kernel's OOM killer.
            return (
                "killed",
                -sig,
                "killed by SIGKILL, which the sandbox did not send: the program killed itself "
                "or its own process group (or the kernel's out-of-memory killer ended it)",
            )
        return "killed", -sig, f"killed by {_signal_name(sig)}"
    rc = os.WEXITSTATUS(status)
    if rc == 0:
        return "ok", 0, ""
    last = _last_line(stderr)
    if last.startswith("MemoryError"):
        return "memory", rc, f"memory limit exceeded: {last}"
    return "error", rc, f"exit code {rc}: {last}" if last else f"exit code {rc}"


def _supervise(proc, report_r, uid, t0, timeout_s, cpu_s, max_output_bytes) -> SandboxResult:
    """Collect the launched program's output under the deadline and the output cap, kill
    whatever is left of its sandbox, and say how it ended."""
    deadline = t0 + timeout_s
    bufs, report, over_output, timed_out = _read_until_done(
        proc, report_r, deadline, max_output_bytes
    )
    if not (timed_out or over_output):
        try:
            proc.wait(timeout=max(0.05, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    # Before reading state: nothing may keep running.
    _kill_all(proc, uid, _parse_report(report).get("child_pid"))
    wall = time.monotonic() - t0
    with contextlib.suppress(OSError):  # the launcher's last words, if it reported before dying
        while chunk := os.read(report_r, 65536):
            report += chunk
    info = _parse_report(report)
    enforced = info.get("enforced", {})
    stdout = bytes(bufs[proc.stdout.fileno()][:max_output_bytes]).decode("utf-8", "replace")
    stderr = bytes(bufs[proc.stderr.fileno()][:max_output_bytes]).decode("utf-8", "replace")

    def result(status, rc, reason):
        return SandboxResult(status, rc, stdout, stderr, reason, wall, enforced)

    ran = bool(info.get("exec"))  # the program's execve succeeded: from here on, its doing
    if "setup_error" in info and not ran:
        return result("sandbox_error", None, info["setup_error"])
    if over_output:
        return result("output_limit", None, f"output exceeded {max_output_bytes} bytes")
    if timed_out:
        return result("timeout", None, f"wall-clock limit of {timeout_s:g} s exceeded")
    if "forged" in info:
        return result(
            "tampered",
            None,
            "the program wrote into its sandbox's report channel (a forged setup failure: "
            f"{str(info['forged'])[:200]!r})",
        )
    if "wait_status" not in info:
        return result(*_unreported_end(info, proc))
    return result(*_program_end(info, cpu_s, stderr))


def run_many(jobs: Iterable[str | dict], *, workers: int = 4, **defaults) -> list[SandboxResult]:
    """Run many programs with at most ``workers`` running at once; results in job order.

    Each job is a code string, or a dict of ``run_program`` keyword arguments including
    ``code``; ``defaults`` are keyword arguments applied to every job (a job's own keys win),
    e.g. ``run_many(codes, limits=SandboxLimits(timeout_s=3.0), mechanism=mechanism)``.
    """
    if workers < 1:
        raise ValueError(f"run_many: workers must be >= 1, got {workers}")
    kwargs_list = []
    for i, job in enumerate(jobs):
        if isinstance(job, str):
            kwargs_list.append({**defaults, "code": job})
        elif isinstance(job, dict) and isinstance(job.get("code"), str):
            kwargs_list.append({**defaults, **job})
        else:
            raise ValueError(f"run_many: job {i} must be a code string or a dict with 'code'")
    if not kwargs_list:
        return []

    def one(kw: dict) -> SandboxResult:
        kw = dict(kw)
        return run_program(kw.pop("code"), **kw)

    with ThreadPoolExecutor(max_workers=min(workers, len(kwargs_list))) as pool:
        return list(pool.map(one, kwargs_list))
