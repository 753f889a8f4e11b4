"""The common base of errors a user can fix, so the CLI can print them without a traceback.

An error that subclasses ``PeergradeError`` carries a complete message: it names the file, row,
key or argument at fault and what was expected. ``peergrade`` prints it as one line
``error: <message>`` and exits with status 2. Anything else is a bug and keeps its traceback.

The concrete classes live next to the code that raises them (``ModelLoadError`` here, shared
by models and gguf; ``DataError`` in tasks.files, ``RewardError`` in rewards, ``RunDirError`` in checkpoint); each
also keeps its historical builtin base (``ValueError`` / ``RuntimeError``) so existing
``except ValueError`` code still catches it. ``user_input`` turns a plain ValueError raised while
resolving a user-given name into an ``InputError``. ``require`` imports an optional package or
raises ``MissingPackageError`` with the pip command, so every missing extra (pandas for CSV, peft
for LoRA, ...) is the same one ``error:`` line.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from types import ModuleType


class PeergradeError(Exception):
    """An error caused by the user's input (config, data, model dir, reward, run dir)."""


class InputError(PeergradeError, ValueError):
    """Bad user input that has no more specific class (unknown task or reward name, bad option)."""


class ModelLoadError(PeergradeError, ValueError):
    """A model or tokenizer directory is missing something, or is not a causal LM."""


class MissingPackageError(PeergradeError, ImportError):
    """An optional package that a feature needs is not installed (the message has the pip
    command). Also an ``ImportError``, so code that falls back on a missing package still can."""


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
