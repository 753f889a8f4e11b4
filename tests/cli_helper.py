"""Running the ``peergrade`` CLI in a subprocess, as a user would, for the tests that need it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def cli(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``peergrade ARGS`` in ``cwd`` with one torch thread; output captured as text."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "peergrade.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
