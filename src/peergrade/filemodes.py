"""File modes of what peergrade writes: those a plain ``open`` / ``mkdir`` gives under the
user's umask (0644 / 0755 for the usual 022), so a shared checkpoint or export is readable by
the team. Temp files (``mkstemp``: 0600), temp directories (``mkdtemp``: 0700) and
safetensors' writer (0600) would otherwise leave ``config.yaml`` and ``model.safetensors``
private; the writers call ``apply_umask`` / ``file_mode`` before their rename into place.

This module writes no file itself and decides nothing about where files go.
"""

from __future__ import annotations

import os
from pathlib import Path


def umask() -> int:
    """The process's umask (reading it means setting it: it is put straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0666 & ~umask."""
    return 0o666 & ~umask()


def apply_umask(directory: Path) -> None:
    """Give ``directory`` and everything in it the modes a plain ``open`` / ``mkdir`` would
    under the user's umask (files 0666 & ~umask, directories 0777 & ~umask)."""
    mask = umask()
    directory = Path(directory)
    for p in [directory, *directory.rglob("*")]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)
