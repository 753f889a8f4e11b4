"""One writer per run directory, and a fresh directory for every run that names none.

A run directory (and a sweep directory) is written by one process at a time: the writer holds an
exclusive ``flock`` on ``<dir>/.lock`` (``LOCK_NAME``) for its whole life, with its pid and host
written in the file. A second writer -- another ``peergrade train -o`` of the same directory, a
second ``--resume`` of one run, ``peergrade.train`` or ``GRPOTrainer`` writing it from Python --
fails at once with ``RunInUseError``, one line naming the holder's pid, before it writes anything
into the directory. The kernel drops the lock when the holder exits, however it exits (SIGKILL
included), so a stale ``.lock`` left by a killed run never blocks the next writer; a clean
release removes the file.

``claim_new`` makes the default ``runs/<date>-<time>`` directory with ``os.mkdir`` (which fails
when the name exists) and takes the next of ``-2``, ``-3``, ... when the second is taken, so two
runs started in the same second get two directories. A directory made here and left empty (the
run failed before writing anything) is removed again on release.

Readers (``peergrade eval``, ``export``, ``report``) never take the lock; whatever lists a run
directory's files ignores ``LOCK_NAME``.

What it deliberately does not do: decide what a run directory must contain (``checkpoint``),
coordinate ranks under torchrun (``checkpoint.claimed_run_dir``: rank 0 holds the lock), or wait
for a busy directory (a second writer is an error, never a queue).
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from pathlib import Path

from peergrade.errors import PeergradeError

try:
    import fcntl
except ImportError:  # not POSIX: no locking (the run directory is still unique by name)
    fcntl = None

__all__ = [
    "DEFAULT_RUN_DIR",
    "LOCK_NAME",
    "RunLock",
    "RunInUseError",
    "RunLockError",
    "acquire",
    "check_free",
    "claim_new",
]

#: the lock file inside a run (or sweep) directory; not part of the run
LOCK_NAME = ".lock"
#: where a run goes when no output directory is given (``time.strftime``; -2, -3, ... if taken)
DEFAULT_RUN_DIR = "runs/%Y%m%d-%H%M%S"
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class RunLockError(PeergradeError, RuntimeError):
    """A run directory whose lock cannot be taken (or made)."""


class RunInUseError(RunLockError):
    """A run directory that another process is writing: the message names its pid."""


class RunLock:
    """The held lock of ``directory``; ``release`` (or leaving the ``with``) gives it up, removes
    the lock file, and removes the directories made for it when they are still empty."""

    def __init__(self, directory: Path, fd: int | None, made: list[Path]):
        self.directory, self.fd, self.made = directory, fd, made

    def release(self) -> None:
        if self.fd is None:
            return
        path = self.directory / LOCK_NAME
        try:
            if _same_file(self.fd, path):
                os.unlink(path)  # before the unlock: a waiter that opened it retries (_same_file)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None
        _remove_if_empty(self.made)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire(directory: Path, *, create: bool = False) -> RunLock:
    """Hold ``directory``'s lock (``RunInUseError`` naming the holder's pid when another process
    holds it). ``create``: make the directory (and its parents) when missing; what was made is
    removed again on release if still empty, and at once when the lock is refused."""
    directory = Path(directory)
    made = _make_dirs(directory) if create else []
    try:
        return _lock(directory, made)
    except BaseException:
        _remove_if_empty(made)
        raise


def claim_new(pattern: str = DEFAULT_RUN_DIR) -> RunLock:
    """A new directory named ``time.strftime(pattern)``, or that name plus ``-2``, ``-3``, ...
    when taken, made atomically (``os.mkdir``) and locked."""
    base = Path(time.strftime(pattern))
    made = _make_dirs(base.parent, base)
    try:
        for n in itertools.count(1):
            path = base if n == 1 else base.with_name(f"{base.name}-{n}")
            try:
                os.mkdir(path)
            except FileExistsError:
                continue
            except OSError as exc:
                raise RunLockError(
                    f"cannot create run directory {str(path)!r}: {exc.strerror or exc}"
                ) from None
            try:
                return _lock(path, [path, *made])
            except RunInUseError:  # a writer naming it explicitly took it first: the next name
                continue
    except BaseException:
        _remove_if_empty(made)
        raise


def check_free(directory: Path) -> None:
    """``RunInUseError`` naming the holder when ``directory``'s lock is held (by another
    process, or by another writer in this one); creates and changes nothing (the check before a
    writer makes or loads anything)."""
    if fcntl is None:
        return
    directory = Path(directory)
    try:
        fd = os.open(directory / LOCK_NAME, os.O_RDONLY | _O_CLOEXEC)
    except OSError:  # no lock file (or none we may read): nobody is writing it
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunInUseError(_busy(directory, fd)) from None
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- helpers


def _lock(directory: Path, made: list[Path]) -> RunLock:
    if fcntl is None:
        return RunLock(directory, None, made)
    path = directory / LOCK_NAME
    refused = 0
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | _O_CLOEXEC, 0o666)
        except OSError as exc:
            raise RunLockError(
                f"run directory {str(directory)!r} cannot be locked: creating {str(path)!r} "
                f"failed ({exc.strerror or exc})"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            refused += 1
            if refused < 10:  # check_free's probe holds it for a moment only
                os.close(fd)
                time.sleep(0.02)
                continue
            message = _busy(directory, fd)
            os.close(fd)
            raise RunInUseError(message) from None
        if not _same_file(fd, path):  # its holder released (and removed) it meanwhile
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        return RunLock(directory, fd, made)


def _busy(directory: Path, fd: int) -> str:
    """The one line a second writer gets: who holds ``directory`` (its lock file's pid)."""
    words: list[str] = []
    for _ in range(50):  # the holder writes its pid just after it takes the lock
        os.lseek(fd, 0, os.SEEK_SET)
        words = os.read(fd, 512).decode("utf-8", "replace").split()
        if words:
            break
        time.sleep(0.02)
    lock = str(directory / LOCK_NAME)
    if not words:
        who = f"another process (no pid in {lock!r} yet)"
    else:
        pid, host = words[0], (words[1] if len(words) > 1 else socket.gethostname())
        here = host == socket.gethostname()
        who = f"this process (pid {pid})" if here and pid == str(os.getpid()) else f"process {pid}"
        if not here:
            who += f" on host {host}"
        who += f" (its pid is in {lock!r})"
    return (
        f"run directory {str(directory)!r} is in use by {who}: one process writes a run "
        "directory at a time; wait for that run to end, or write to another directory"
    )


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _make_dirs(directory: Path, run_dir: Path | None = None) -> list[Path]:
    """Make ``directory`` and its missing parents (for ``run_dir``, the one an error names);
    returns the ones made, deepest first."""
    missing = []
    p = directory
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    made = []
    try:
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                continue  # made by another process meanwhile: not ours to remove
            made.insert(0, d)
    except OSError as exc:
        _remove_if_empty(made)
        raise RunLockError(
            f"cannot create run directory {str(run_dir or directory)!r}: {exc.strerror or exc} "
            f"({exc.filename})"
        ) from None
    return made


def _remove_if_empty(made: list[Path]) -> None:
    for d in made:  # deepest first; stops at the first one that holds something
        try:
            os.rmdir(d)
        except OSError:
            return
