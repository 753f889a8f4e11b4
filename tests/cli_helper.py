"""Running the ``peergrade`` CLI in a subprocess, as a user would, for the tests that need it."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def train_with_engine(opts: dict[str, str], tmp_path: Path, timeout: float = 600) -> list[dict]:
    """``peergrade train --KEY VALUE ... -o run`` in ``tmp_path`` with another rollout engine:
    it exits 0 without a traceback and logs the engine's gap to the trainer's forward on its
    two steps; the steps' metrics lines (those with ``engine/logp_gap_mean``) are returned."""
    args = ["train", *[x for k, v in opts.items() for x in (f"--{k}", v)], "-o", "run"]
    proc = cli(args, tmp_path, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "engine/logp_gap_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    return steps


def imported_modules(path: Path) -> list[str]:
    """Every module a Python file imports (``import x`` and ``from x import y``)."""
    tree = ast.parse(Path(path).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    return names + [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]


def train_harness_example(
    example: Path, tmp_path: Path, *extra: str, env: dict | None = None, timeout: float = 600
) -> list[dict]:
    """A harness example's smoke run: ``peergrade train --config EXAMPLE/config.yaml`` for two
    tiny steps in a subprocess (one thread, this checkout's ``src``), checked as a user would:
    it exits 0 and prints the held-out table, and both steps trained with no failed episode,
    each with a request to the endpoint and the harness's reward. Returns those steps' metrics."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), **(env or {})}
    tiny = {
        "--steps": 2,
        "--rollout.prompts_per_step": 2,
        "--rollout.group_size": 2,
        "--train.eval_size": 2,
        "--train.eval_samples": 1,
        "--train.threads": 1,
        "--train.save_every": 0,
    }
    cmd = [sys.executable, "-m", "peergrade", "train", "--config", str(example / "config.yaml")]
    cmd += [str(x) for kv in tiny.items() for x in kv] + list(extra)
    out = subprocess.run(
        cmd + ["-o", str(tmp_path / "run")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "held-out accuracy" in out.stdout
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in steps if "loss/policy" in m]
    assert len(trained) == 2
    for m in trained:
        assert m["harness/failed"] == 0.0 and m["harness/requests_mean"] >= 1
        assert "reward/harness/mean" in m and m["episode/stop_reason/done"] > 0
    return trained
