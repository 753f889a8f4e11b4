"""File modes, whole-or-nothing writes and the one JSON-lines reader, shared by everything that writes a run or a model.

What peergrade writes gets the modes a plain ``open`` / ``mkdir`` gives under the user's umask
(0644 / 0755 for the usual 022), so a shared checkpoint, export or converted model is readable
by the team. Temp files and directories (``mkstemp`` / ``mkdtemp``: 0600 / 0700) and
safetensors' writer (0600) would otherwise leave them private: ``atomic_write_text`` sets its
temp file's mode, and ``apply_umask`` a directory's before its rename into place.

This module imports nothing from peergrade, so the model loaders (``models``, ``gguf``) and the
run directory (``checkpoint``) can all use it without an import cycle. It does not decide what
is written or where.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

__all__ = ["PYTHON_ONLY", "apply_umask", "atomic_write_text", "current_umask", "read_jsonl"]

#: how config.yaml records what the Python API was given as an object (a dataset held in memory,
#: a tool defined in ``__main__``): never a path; loading it from the command line is an error
#: that says to resume from Python (``components.build_task``, ``envs.load.load_object``)
PYTHON_ONLY = "python-object:"


def current_umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


def apply_umask(directory: Path) -> None:
    """Give ``directory`` and everything in it the modes a plain ``open`` / ``mkdir`` would
    under the user's umask (files 0666 & ~umask, directories 0777 & ~umask)."""
    mask = current_umask()
    directory = Path(directory)
    for p in [directory, *directory.rglob("*")]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (temp file + rename); it keeps the mode of the file it
    replaces, and a new one gets the umask's (mkstemp's own 0600 would make it private)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            mode = os.stat(path).st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o666 & ~current_umask()
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_jsonl(path: Path, notes: list[str] | None = None) -> list[dict]:
    """Rows of a JSON-lines file (none when it does not exist). A last line without its newline
    that does not parse is a write cut short (a run killed or still writing): dropped. Any
    other line that does not parse, or is not an object, is skipped. Each drop is noted in
    ``notes`` (naming the file and line) when a list is given."""
    if notes is None:
        notes = []
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            last = i == len(lines)  # no newline after it: the writer was interrupted
            if last:
                notes.append(
                    f"{path.name}: last line {i} is incomplete (run still going or killed); ignored"
                )
            else:
                notes.append(f"{path.name}: line {i} is not valid JSON ({e.msg}); skipped")
            continue
        if not isinstance(obj, dict):
            notes.append(f"{path.name}: line {i} is not a JSON object; skipped")
            continue
        rows.append(obj)
    return rows
