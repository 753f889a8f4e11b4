"""examples/verifiers_harness: verifiers 0.4's own agent loop (``verifiers.v1``: its env,
interception server, MCP tool server and chat program) run as a harness, one verifiers rollout
per episode, trained by ``peergrade train --config examples/verifiers_harness/config.yaml``
(a CPU smoke run in a subprocess; no network: the ``local_chat`` harness)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1")
pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "verifiers_harness"


def test_the_example_imports_nothing_of_peergrade():
    for name in ("agent.py", "vf_arith.py", "local_chat.py"):
        tree = ast.parse((EXAMPLE / name).read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [x for x in names if x.split(".")[0] == "peergrade"], name


def test_two_tiny_steps_train_through_verifiers_rollouts(tmp_path):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT / "src"),
        "VF_HARNESS": "local_chat",
    }
    cmd = [
        sys.executable,
        "-m",
        "peergrade",
        "train",
        "--config",
        str(EXAMPLE / "config.yaml"),
        "--steps",
        "2",
        "--rollout.prompts_per_step",
        "2",
        "--rollout.group_size",
        "2",
        "--train.eval_size",
        "2",
        "--train.eval_samples",
        "1",
        "--train.threads",
        "1",
        "--train.save_every",
        "0",
        "--harness.concurrency",
        "4",
        "-o",
        str(tmp_path / "run"),
    ]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "held-out accuracy" in out.stdout
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in steps if "loss/policy" in m]
    assert len(trained) == 2
    for m in trained:
        assert m["harness/failed"] == 0.0 and m["harness/requests_mean"] >= 1
        assert "reward/harness/mean" in m and m["episode/stop_reason/done"] > 0
        assert m["harness/messages"] >= 2  # the verifiers trace's messages: prompt and reply
