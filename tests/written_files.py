"""Compare a file peergrade writes with the one bundled under ``src/peergrade/assets/``.

The bundled model directories were written by the transformers and tokenizers of the day they
were built, and those libraries stamp their own version into what they write
(``"transformers_version"`` in config.json and generation_config.json). A fresh install resolves
newer releases, so a byte comparison fails on a stamp that says nothing about our code (issue
60). JSON files are compared as parsed content without the version stamps; any other file byte
for byte.
"""

from __future__ import annotations

import json
from pathlib import Path

# keys a library writes with its own version (never peergrade's choice)
VERSION_STAMPS = frozenset({"transformers_version"})


def written_content(path: Path):
    """What a test compares of ``path``: parsed JSON less the version stamps, or the bytes."""
    if path.suffix != ".json":
        return path.read_bytes()
    return _without_stamps(json.loads(path.read_text()))


def _without_stamps(value):
    if isinstance(value, dict):
        return {k: _without_stamps(v) for k, v in value.items() if k not in VERSION_STAMPS}
    if isinstance(value, list):
        return [_without_stamps(v) for v in value]
    return value


def assert_same_written(ours: Path, shipped: Path, names) -> None:
    """Each of ``names`` in directory ``ours`` has the content of the one in ``shipped``."""
    for name in names:
        assert written_content(ours / name) == written_content(shipped / name), name
