"""The one family of errors a user can fix, and the one place that prints them.

An error that subclasses ``PeergradeError`` carries a complete message: it names the file, row,
key or argument at fault and what was expected. ``peergrade`` prints it through ``report`` as
one line ``error: <message>`` and exits with status 2. Anything else is a bug and keeps its
traceback.

The family::

    PeergradeError
      InputError        bad input with no more specific class: an unknown task or reward name, a
                        bad option, a command line that cannot be parsed (``cli.UserError`` is
                        this class under its old name)
      ConfigError       a bad config key or value (``peergrade.config`` raises it; also importable
                        from there)
      ModelLoadError    a model or tokenizer directory is missing something (models, gguf)
      MissingPackageError  an optional package a feature needs is not installed (``require``)
      UserCodeError     the user's environment raised, exited or hung (named, with the row)
      ...               next to the code that raises them: ``DataError`` (tasks.files),
                        ``RewardError`` (rewards), ``RunDirError`` (checkpoint),
                        ``RunLockError`` (run_lock: a run directory another process writes)

Each also keeps its historical builtin base (``ValueError`` / ``RuntimeError``) so existing
``except ValueError`` code still catches it. ``user_input`` turns a plain ValueError raised while
resolving a user-given name into an ``InputError``. ``require`` imports an optional package or
raises ``MissingPackageError`` with the pip command, so every missing extra (pandas for CSV, peft
for LoRA, ...) is the same one ``error:`` line.

What it deliberately does not do: decide what is a user error for another module (that module
raises the class), or catch anything itself.
"""

from __future__ import annotations

import importlib
import sys
from contextlib import contextmanager
from types import ModuleType

USER_ERROR_STATUS = 2  # the exit status of a user error (argparse's for a bad command line)


class PeergradeError(Exception):
    """An error caused by the user's input (config, data, model dir, reward, run dir)."""


class InputError(PeergradeError, ValueError):
    """Bad user input that has no more specific class (unknown task or reward name, bad option,
    a command line that cannot be parsed)."""


class ConfigError(PeergradeError, ValueError):
    """A bad config key or value; the message names the key and what is allowed."""


class ModelLoadError(PeergradeError, ValueError):
    """A model or tokenizer directory is missing something, or is not a causal LM."""


class MissingPackageError(PeergradeError, ImportError):
    """An optional package that a feature needs is not installed (the message has the pip
    command). Also an ``ImportError``, so code that falls back on a missing package still can."""


class UserCodeError(PeergradeError, RuntimeError):
    """The user's own code (an environment's ``reset`` / ``step``) raised, exited or hung: the
    message names the user's class or function, the row, and the exception with its file and
    line."""


class Stop(KeyboardInterrupt):
    """A stop that a Ctrl-C or SIGTERM asked for, raised by the trainer's signal handler
    (``training.checkpoint.StopFlag``): never the user's code's own ``KeyboardInterrupt``."""


class Terminated(Stop):
    """The stop a SIGTERM asked for (preemption, ``docker stop``, a job scheduler), raised
    where a Ctrl-C raises ``KeyboardInterrupt``: ``peergrade.Terminated``. The CLI exits 143
    for it (130 for a Ctrl-C); from Python, ``GRPOTrainer.train()`` and ``peergrade.train()``
    raise it once the run has saved what it can, so a script can catch it (it is a
    ``KeyboardInterrupt``, so code that catches that catches it too)."""

    def __init__(self, message: str = "") -> None:
        super().__init__(
            message
            or "stopped by SIGTERM: the run saved its last checkpoint (if it had reached one); "
            "resume it to continue (docs/resume.md)"
        )


def users_own_stop(exc: BaseException) -> bool:
    """Whether ``exc``, caught around a call of user code, is that code's own doing: a
    ``SystemExit``, or a ``KeyboardInterrupt`` that no Ctrl-C sent (not a ``Stop``, while a
    handler other than Python's default one owns SIGINT, so a real Ctrl-C would be a ``Stop``)."""
    import signal

    if isinstance(exc, SystemExit):
        return True
    if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, Stop):
        return signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    return False


def describe_exit(exc: BaseException) -> str:
    """``SystemExit`` / ``KeyboardInterrupt`` raised by user code, in words."""
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r})"
    return "raised KeyboardInterrupt"


def where_raised(exc: BaseException) -> str:
    """`` (at file.py:line)``: the innermost frame of ``exc``'s traceback, or nothing."""
    import traceback
    from pathlib import Path

    tb = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    return f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""


def require(module: str, *, needed_for: str, pip: str, extra: str | None = None) -> ModuleType:
    """Import ``module`` (e.g. ``"pandas"``) or raise ``MissingPackageError``:
    ``<needed_for> needs <pip>, which is not installed: pip install <pip>`` (and the
    ``peergrade[<extra>]`` that brings it, when there is one)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        # a package that is there but lacks one of its own dependencies: name that one
        missing = exc.name or module
        detail = "" if module.startswith(missing) else f" (importing {missing!r} failed)"
        hint = f"pip install {pip}" + (f"  (or pip install 'peergrade[{extra}]')" if extra else "")
        raise MissingPackageError(
            f"{needed_for} needs {pip}, which is not installed{detail}: {hint}"
        ) from None


@contextmanager
def user_input(what: str):
    """Re-raise a ValueError from resolving the user's ``what`` as an InputError (a clean CLI
    message): load_task / make_reward_spec raise ValueError only for names, options and files
    the user gave."""
    try:
        yield
    except PeergradeError:
        raise
    except ValueError as e:
        raise InputError(f"{what}: {e}") from e


def report(error: PeergradeError, file=None) -> int:
    """Print ``error`` as one ``error: ...`` line (stderr by default); the exit status to use."""
    print(f"error: {error}", file=file or sys.stderr)
    return USER_ERROR_STATUS


#: address space that importing torch (2.13, CPU) maps before any model: 0.6 GiB measured
TORCH_IMPORT_VIRTUAL_GIB = 0.6


def out_of_memory(exc: BaseException) -> str:
    """One line for a ``MemoryError`` (or a shared library that could not be mapped, torch's
    ``failed to map segment``): the cause, naming the process's address-space limit when one
    is set (``ulimit -v``), since that limit counts mapped, not used, memory."""
    import resource

    what = (
        f"a shared library could not be mapped ({exc})"
        if isinstance(exc, ImportError)
        else "out of memory"
    )
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        return (
            f"{what}: this process may map at most {soft / 2**30:.2f} GiB of address space "
            f"(ulimit -v {soft // 1024}); that limit counts mapped memory, not memory used, "
            f"and importing torch alone maps about {TORCH_IMPORT_VIRTUAL_GIB} GiB: raise it "
            "(ulimit -v unlimited), or limit resident memory instead (a cgroup, docker --memory)"
        )
    return (
        f"{what}: the machine had no memory left for this run; `peergrade memory --config X` "
        "estimates what a run needs and what fits (smaller optim.micro_batch_size, "
        "rollout.generation_batch_size or model.lora cut it)"
    )
