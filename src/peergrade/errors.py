"""The common base of errors a user can fix, so the CLI can print them without a traceback.

An error that subclasses ``PeergradeError`` carries a complete message: it names the file, row,
key or argument at fault and what was expected. ``peergrade`` prints it as one line
``error: <message>`` and exits with status 2. Anything else is a bug and keeps its traceback.

The concrete classes live next to the code that raises them (``ModelLoadError`` in models,
``DataError`` in tasks.files, ``RewardError`` in rewards, ``RunDirError`` in checkpoint); each
also keeps its historical builtin base (``ValueError`` / ``RuntimeError``) so existing
``except ValueError`` code still catches it. This module defines no behaviour.
"""

from __future__ import annotations


class PeergradeError(Exception):
    """An error caused by the user's input (config, data, model dir, reward, run dir)."""


class InputError(PeergradeError, ValueError):
    """Bad user input that has no more specific class (unknown task or reward name, bad option)."""
