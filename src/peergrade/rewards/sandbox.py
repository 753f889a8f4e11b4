"""Run untrusted Python programs (model completions) in a constrained child process.

The code reward executes text written by the policy: this module is the one place where
untrusted code runs. ``run_program`` runs one program and always returns a ``SandboxResult``
(it never raises for anything the program does); ``run_many`` runs a list of programs through
a bounded pool of supervising threads, each of which owns one child process at a time.

How one program runs
--------------------
The supervisor (this process) writes the program to ``main.py`` in a fresh temp directory and
starts a *launcher*: this same file run as ``python -I -S sandbox.py <config>``, in a new
session (its own process group). When we are root and the kernel allows it, the launcher:

1. unshares new mount, PID, network, IPC and UTS namespaces (``unshare(2)`` through ctypes;
   Python 3.11 has no ``os.unshare``);
2. makes every mount private and remounts each one read-only and nosuid inside the new mount
   namespace, so nothing outside the work directory can be written (``/tmp``, ``/dev/shm`` and
   the repository included); directories on the interpreter's path that an unprivileged uid
   cannot traverse (``/root`` is 0700 here) are replaced by an empty tmpfs into which only the
   interpreter's prefix directories are bind-mounted back, which also hides the rest of them;
3. mounts a size-capped tmpfs (``disk_mb``) owned by the sandbox uid over the work directory
   and copies ``main.py`` (and any ``files``) into it: the program's files never touch the disk
   and vanish with it;
4. forks a minimal init, PID 1 of the new PID namespace, which mounts a fresh ``/proc`` and
   forks the program (PID 2). The program's process sets the resource limits, drops to a
   per-program unprivileged uid/gid (no supplementary groups), sets ``PR_SET_NO_NEW_PRIVS`` and
   ``PR_SET_PDEATHSIG`` and execs ``python -I main.py`` with a minimal environment. The init
   reaps orphans and reports the program's wait status and CPU time on a private pipe; the
   launcher stays outside the namespace and waits for the init.

Resource limits (``setrlimit``): RLIMIT_CPU (CPU seconds, per process), RLIMIT_AS (address
space, per process), RLIMIT_NPROC (processes of the sandbox uid, which is unique per running
program, so it is a per-program count), RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE = 0.

The supervisor reads stdout and stderr with a byte cap (beyond it: kill, ``output_limit``) and a
wall-clock deadline (beyond it: kill, ``timeout``). Killing is SIGKILL to the namespace's init,
upon which the kernel kills every process left in that namespace (including ones that called
``setsid()`` to leave the process group), then ``killpg(SIGKILL)`` of the launcher's group.
The temp directory is removed afterwards.

Threat model
------------
Adversary: a program that tries to hang, exhaust CPU/memory/processes/output/disk, write or
read outside its directory, read the trainer's secrets (environment), reach the network, or
signal the trainer or other programs. See docs/sandbox.md for the table of what is enforced on
which setup. Not defended against: kernel exploits (no seccomp filter, no VM boundary), reading
world-readable files (they are visible, only read-only), total memory of a program that forks
(RLIMIT_AS is per process: up to ``max_processes * memory_mb``), and CPU time of the pool as a
whole beyond ``workers`` cores. Where ``unshare`` is refused (root without CAP_SYS_ADMIN), the
uid drop and rlimits still apply but files and network are reachable; without root (or with
``isolate=False``) it falls back to rlimits + a new session + process-group kill. What was in
force is recorded in ``SandboxResult.enforced``; the non-root mode is NOT a security boundary.

What this module deliberately does not do: score programs (see ``peergrade.rewards.code``),
install packages for programs, or run anything but Python.
"""

from __future__ import annotations

import marshal
import os
import sys

# This file doubles as the launcher script (``python -I -S sandbox.py``): the launcher part
# comes first and ends in ``_launcher_main``, which never returns, so the launcher does not pay
# for the supervisor's imports below (a third of the per-program start-up time).

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "killed", "sandbox_error")
"""Every value ``SandboxResult.status`` can take.

ok: exit code 0. error: non-zero exit (the reason is the last stderr line, e.g. an uncaught
exception or ``BlockingIOError`` from the process limit). timeout: the wall-clock or CPU limit
was hit. memory: ``MemoryError`` (or a crash) under the address-space limit. output_limit:
stdout + stderr exceeded ``max_output_bytes``. killed: ended by a signal. sandbox_error: the
sandbox itself could not be set up (the program never ran)."""

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


def _mountinfo_points() -> list[tuple[str, int]]:
    """(mount point, per-mount flags) of every mount, in /proc/self/mountinfo order."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # octal escapes such as \040
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


def _expose(libc, paths: list[str]) -> list[str]:
    """Make ``paths`` traversable by an unprivileged uid inside this mount namespace.

    For each path, the first ancestor without the others-execute bit is covered by a tmpfs and
    the path is bind-mounted back into it; everything else in that ancestor becomes invisible.
    Returns the covered ancestors.
    """
    blocked = _blocked_ancestors(paths)
    for anc, inner in blocked.items():
        fds = {p: os.open(p, os.O_PATH) for p in inner}  # keep the real dirs reachable
        _mount(libc, "tmpfs", anc, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=64k")
        for p, fd in fds.items():
            if p != anc:
                os.makedirs(p, exist_ok=True)
            _mount(libc, f"/proc/self/fd/{fd}", p, None, _MS_BIND | _MS_REC, None)
            os.close(fd)
    return sorted(blocked)


def _launcher_main(config_hex: str) -> None:
    # marshal, not json: it is built in, and importing json (re, enum) costs ~15 ms per program.
    cfg = marshal.loads(bytes.fromhex(config_hex))
    report = cfg["report_fd"]

    def send(obj) -> None:
        os.write(report, marshal.dumps(obj).hex().encode() + b"\n")

    libc = _libc()
    enforced: dict[str, object] = {}
    workdir, uid = cfg["workdir"], cfg["uid"]
    isolate = cfg["isolate"] and os.geteuid() == 0
    try:
        pid_ns = False
        if isolate:
            # Network first on its own: it is the one a kernel config most often lacks.
            if cfg["network_namespace"]:
                enforced["network_namespace"] = libc.unshare(_CLONE_NEWNET) == 0
            else:
                enforced["network_namespace"] = False
            enforced["mount_namespace"] = libc.unshare(_CLONE_NEWNS | _CLONE_NEWIPC) == 0
            enforced["uts_namespace"] = libc.unshare(_CLONE_NEWUTS) == 0
            pid_ns = libc.unshare(_CLONE_NEWPID) == 0
            enforced["pid_namespace"] = pid_ns
        if enforced.get("mount_namespace"):
            _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE, None)
            enforced["hidden_dirs"] = _expose(libc, cfg["expose"])
            files = {}
            for name in os.listdir(workdir):
                with open(os.path.join(workdir, name), "rb") as f:
                    files[name] = f.read()
            ro_failed = []
            for point, flags in _mountinfo_points():
                try:
                    _mount(
                        libc,
                        None,
                        point,
                        None,
                        _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | flags,
                        None,
                    )
                except OSError:
                    ro_failed.append(point)
            enforced["read_only_mounts_failed"] = ro_failed
            enforced["read_only_root"] = not ro_failed
            data = f"size={int(cfg['disk_mb'])}m,mode=0700,uid={uid},gid={uid}"
            _mount(libc, "tmpfs", workdir, "tmpfs", _MS_NOSUID | _MS_NODEV, data)
            for name, content in files.items():
                fd = os.open(os.path.join(workdir, name), os.O_WRONLY | os.O_CREAT, 0o644)
                os.write(fd, content)
                os.close(fd)
                os.chown(os.path.join(workdir, name), uid, uid)
            enforced["tmpfs_workdir_mb"] = int(cfg["disk_mb"])
        else:
            enforced["read_only_root"] = False
            blocked = _blocked_ancestors(cfg["expose"]) if isolate else {}
            if blocked:
                enforced["unprivileged_uid"] = True
                send(
                    {
                        "enforced": enforced,
                        "setup_error": f"the interpreter lies under {sorted(blocked)}, which an "
                        "unprivileged uid cannot traverse, and no mount namespace is available to "
                        "expose it: install Python where other users can read it, or pass "
                        "isolate=False (not a security boundary)",
                    }
                )
                os._exit(127)
    except OSError as exc:
        send({"setup_error": f"launcher: {exc}"})
        os._exit(127)
    enforced["unprivileged_uid"] = isolate
    send({"enforced": enforced})

    if not pid_ns:
        _spawn_and_wait(libc, cfg, isolate, send, report_pid=True)
        os._exit(0)
    pid = os.fork()
    if pid == 0:
        # PID 1 of the new namespace: a minimal init that stays root, mounts a /proc showing only
        # the namespace, runs the program as PID 2 and reaps orphans. The program is not PID 1
        # because the kernel ignores default-action signals (SIGXCPU, SIGABRT) sent to PID 1.
        try:
            _check(libc.prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
            _mount(libc, "proc", "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None)
            _spawn_and_wait(libc, cfg, isolate, send, report_pid=False)
        except BaseException as exc:  # noqa: BLE001 - anything here is a setup failure
            send({"setup_error": f"init: {type(exc).__name__}: {exc}"})
            os._exit(127)
        os._exit(0)  # every other process in the namespace is killed with us
    # Launcher: stay outside the PID namespace; killing `pid` (the init) ends the namespace.
    send({"child_pid": pid})
    os.waitpid(pid, 0)
    os._exit(0)


def _spawn_and_wait(libc, cfg: dict, isolate: bool, send, report_pid: bool) -> None:
    """Fork the program, reap every child until it exits, and report its wait status."""
    pid = os.fork()
    if pid == 0:
        try:
            _child_exec(libc, cfg, isolate)
        except BaseException as exc:  # noqa: BLE001 - anything here is a setup failure
            send({"setup_error": f"child: {type(exc).__name__}: {exc}"})
        os._exit(127)
    if report_pid:
        send({"child_pid": pid})
    while True:
        done, status, usage = os.wait4(-1, 0)
        if done == pid:
            break
    send({"wait_status": status, "cpu_s": usage.ru_utime + usage.ru_stime})


def _child_exec(libc, cfg: dict, isolate: bool) -> None:
    import resource

    workdir, uid = cfg["workdir"], cfg["uid"]
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
    if isolate:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
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
import selectors  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterable, Sequence  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402


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


def run_program(
    code: str,
    *,
    stdin: str = "",
    args: Sequence[str] = (),
    files: dict[str, str] | None = None,
    timeout_s: float = 5.0,
    cpu_time_s: float | None = None,
    memory_mb: int = 512,
    max_processes: int = 16,
    max_output_bytes: int = 64_000,
    disk_mb: int = 64,
    max_open_files: int = 64,
    python: str = sys.executable,
    network: bool = False,
    isolate: bool = True,
) -> SandboxResult:
    """Run ``code`` as ``python -I main.py *args`` with ``stdin`` as its input, under the limits.

    files: extra text files written next to ``main.py`` in the work directory, owned by the
    program (it may read, change or delete them). timeout_s: wall clock, from launch to exit (seconds). cpu_time_s: RLIMIT_CPU per process
    (default: ``timeout_s`` rounded up). memory_mb: RLIMIT_AS per process. max_processes:
    RLIMIT_NPROC for the program's uid (the program itself counts). max_output_bytes: cap on
    stdout + stderr together. disk_mb: size of the tmpfs work directory (and the RLIMIT_FSIZE of
    any one file). network=True keeps the host network (no network namespace). isolate=False
    skips namespaces and the uid switch (rlimits, new session and group kill only).
    Never raises for anything the program does; bad arguments raise ValueError.
    """
    if not isinstance(code, str):
        raise ValueError(f"run_program: code must be a str, got {type(code).__name__}")
    if timeout_s <= 0 or memory_mb <= 0 or max_processes <= 0 or max_output_bytes <= 0:
        raise ValueError(
            "run_program: timeout_s, memory_mb, max_processes and max_output_bytes must be > 0"
        )
    files = dict(files or {})
    for name in files:
        if not isinstance(name, str) or not name or "/" in name or name in (".", "..", "main.py"):
            raise ValueError(f"run_program: bad file name {name!r} (a plain name, not main.py)")
    cpu_s = max(1, int(-(-(cpu_time_s if cpu_time_s is not None else timeout_s) // 1)))
    t0 = time.monotonic()
    uid = _acquire_uid()
    workdir = tempfile.mkdtemp(prefix="peergrade-sbx-")
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
    }
    proc = None
    report_r = report_w = -1
    try:
        for name, content in {**files, "main.py": code}.items():
            with open(os.path.join(workdir, name), "w", encoding="utf-8") as f:
                f.write(content)
            os.chmod(os.path.join(workdir, name), 0o644)
            if isolate and os.geteuid() == 0:
                os.chown(os.path.join(workdir, name), uid, uid)
        root = os.geteuid() == 0
        if isolate and root:
            os.chown(workdir, uid, uid)
        nproc = max_processes
        if not root:
            # RLIMIT_NPROC counts every process of our uid: allow what already runs.
            nproc += len(_uid_processes(os.getuid()))
        cfg = {
            "workdir": workdir,
            "uid": uid,
            "isolate": bool(isolate),
            "python": python,
            "args": [str(a) for a in args],
            "env": env,
            "disk_mb": disk_mb,
            "network_namespace": not network,
            "expose": _python_dirs(python) if isolate and root else [],
            "limits": {
                "cpu_s": cpu_s,
                "memory_mb": memory_mb,
                "fsize_mb": disk_mb,
                "nofile": max_open_files,
                "nproc": nproc,
            },
        }
        report_r, report_w = os.pipe()
        cfg["report_fd"] = report_w
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin.encode("utf-8"))
            stdin_file.seek(0)
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), marshal.dumps(cfg).hex()],
                stdin=stdin_file,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(report_w,),
                start_new_session=True,
                env={"PATH": env["PATH"], "LANG": "C.UTF-8"},
                cwd="/",
            )
        os.close(report_w)
        report_w = -1
        return _supervise(proc, report_r, uid, t0, timeout_s, cpu_s, max_output_bytes)
    except OSError as exc:
        return SandboxResult("sandbox_error", None, "", "", f"supervisor: {exc}", 0.0)
    finally:
        if proc is not None:
            _kill_all(proc, uid if isolate else None)
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
    info: dict = {}
    for line in report.decode("ascii", "replace").splitlines():
        with contextlib.suppress(ValueError, EOFError, TypeError):
            info.update(marshal.loads(bytes.fromhex(line)))
    return info


def _supervise(proc, report_r, uid, t0, timeout_s, cpu_s, max_output_bytes) -> SandboxResult:
    deadline = t0 + timeout_s
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

    if "setup_error" in info:
        return result("sandbox_error", None, info["setup_error"])
    if over_output:
        return result("output_limit", None, f"output exceeded {max_output_bytes} bytes")
    if timed_out:
        return result("timeout", None, f"wall-clock limit of {timeout_s:g} s exceeded")
    if "wait_status" not in info:
        return result(
            "sandbox_error", None, f"launcher ended without a report (rc {proc.returncode})"
        )
    status = info["wait_status"]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and info.get("cpu_s", 0) >= cpu_s):
            return result(
                "timeout", -sig, f"CPU time limit of {cpu_s} s exceeded ({_signal_name(sig)})"
            )
        return result("killed", -sig, f"killed by {_signal_name(sig)}")
    rc = os.WEXITSTATUS(status)
    if rc == 0:
        return result("ok", 0, "")
    last = _last_line(stderr)
    if last.startswith("MemoryError"):
        return result("memory", rc, f"memory limit exceeded: {last}")
    return result("error", rc, f"exit code {rc}: {last}" if last else f"exit code {rc}")


def run_many(jobs: Iterable[str | dict], *, workers: int = 4, **defaults) -> list[SandboxResult]:
    """Run many programs with at most ``workers`` running at once; results in job order.

    Each job is a code string, or a dict of ``run_program`` keyword arguments including
    ``code``; ``defaults`` are keyword arguments applied to every job (a job's own keys win).
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
