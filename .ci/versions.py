"""Print what this venv resolved for each bounded dependency, and any newer release outside
its bound (issue 60). Informational: it never fails the run.

The venv is built from scratch, so what it resolved is the newest release each bound allows;
a "newer outside the bound" line says a bound is ready to be tried one step higher.
"""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
specs = [*project["dependencies"], *project["optional-dependencies"]["test"]]
for req in map(Requirement, specs):
    if not any(s.operator in ("<", "<=", "==") for s in req.specifier):
        continue  # a lower bound only: the newest release is what the venv has
    try:
        have = version(req.name)
    except PackageNotFoundError:
        print(f"versions: {req.name} not installed")
        continue
    out = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", req.name],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    found = re.search(r"Available versions: (.*)", out)
    released = [Version(v) for v in found.group(1).split(", ")] if found else []
    newest = max((v for v in released if not v.is_prerelease), default=None)
    beyond = (
        f"; newer outside the bound: {newest}" if newest and newest not in req.specifier else ""
    )
    print(f"versions: {req.name} {have} (bound {req.specifier}){beyond}")
