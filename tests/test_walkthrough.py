"""The new user's walk-through, run from a fresh clone exactly as docs/own-data.md shows it
(issue 23, "Done when"): the page's ``sums.jsonl`` and ``my_rewards.py`` are written from its
code blocks, and its ``peergrade`` commands (train, eval, resume to extend) run in the page's
order through the command line, in a ``git clone`` of this checkout, importing the clone's own
``src``. Only sizes are shrunk (steps, prompts, samples, one thread) so it stays short; nothing
else is added, so a command that stops working as written, or a file the page no longer shows,
fails here.

It does not check the numbers (tests/tasks/test_own_data.py checks each behaviour); it checks that
the walk-through runs start to finish from a clean clone and leaves the files the page names.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = "docs/own-data.md"

# What a short run changes, and nothing else: the value after each of these flags.
SHRINK = {"--steps": "2", "--train.steps": "4", "--n": "2", "--k": "2"}
# Appended to the first `peergrade train`: the resumed run and eval read them from config.yaml.
SMALL = [
    "--rollout.prompts_per_step",
    "2",
    "--rollout.group_size",
    "2",
    "--rollout.max_completion_length",
    "4",
    "--train.eval_size",
    "2",
    "--train.eval_samples",
    "2",
    "--train.threads",
    "1",
    "--train.display",
    "none",
]


def _file_block(page: str, name: str) -> str:
    """The code block right after the line "`name`:" on the page."""
    found = re.search(rf"^`{re.escape(name)}`:\n\n```\w*\n(.*?)```", page, re.S | re.M)
    assert found, f"{PAGE} no longer shows the file {name} (a line `{name}`: then a code block)"
    return found.group(1)


def _commands(page: str) -> list[list[str]]:
    """Every `peergrade ...` line of the page's bash blocks, continuations joined, in order."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", page, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0] == "peergrade":
                commands.append(words[1:])
    return commands


def _shrunk(words: list[str]) -> list[str]:
    out = list(words)
    for i, w in enumerate(out[:-1]):
        if w in SHRINK:
            out[i + 1] = SHRINK[w]
    return out


def _run(clone: Path, words: list[str]) -> str:
    env = {
        **os.environ,
        "PYTHONPATH": str(clone / "src"),
        "OMP_NUM_THREADS": "1",
        "COLUMNS": "100",
    }
    done = subprocess.run(
        [sys.executable, "-m", "peergrade", *words],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, f"peergrade {shlex.join(words)} -> {done.returncode}\n{said}"
    return said


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.mark.slow
def test_walkthrough_runs_from_a_fresh_clone(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    inside = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--show-toplevel"], capture_output=True, text=True
    )
    if inside.returncode != 0 or Path(inside.stdout.strip()).resolve() != ROOT:
        pytest.skip(f"{ROOT} is not the top of a git checkout: nothing to clone")
    clone = tmp_path / "clone"
    subprocess.run(
        ["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, capture_output=True
    )
    # the clone holds committed files only: the page and the code under test must be committed
    page = (clone / PAGE).read_text()

    rows = [json.loads(x) for x in _file_block(page, "sums.jsonl").splitlines() if x.strip()]
    assert rows and all("prompt" in r and "answer" in r for r in rows)
    (clone / "sums.jsonl").write_text(_file_block(page, "sums.jsonl"))
    (clone / "my_rewards.py").write_text(_file_block(page, "my_rewards.py"))

    commands = _commands(page)
    kinds = [(c[0], "--resume" in c) for c in commands]
    assert kinds[0] == ("train", False), f"{PAGE} no longer starts with peergrade train"
    assert ("eval", False) in kinds and ("train", True) in kinds, kinds
    assert kinds.index(("eval", False)) < kinds.index(("train", True)), kinds

    train = _shrunk(commands[0])
    # the later commands name the run directory, so the first must write it there
    assert "-o" in train, f"{PAGE}: the train command names no run directory (-o)"
    run = clone / train[train.index("-o") + 1]
    said = [_run(clone, train + SMALL)]
    metrics = _jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2, 2], metrics
    assert metrics[-1].get("final") is True
    samples = _jsonl(run / "samples.jsonl")
    assert samples and all("prompt_rendered" in s for s in samples), samples[:1]
    assert {s["prompt"] for s in samples} <= {r["prompt"] for r in rows}

    for words in commands[1:]:
        said.append(_run(clone, _shrunk(words)))
        if words[0] == "eval":
            assert re.search(r"pass@1", said[-1]) and "seed" in said[-1], said[-1]

    # the resume extended the run: steps 3 and 4, then a new final evaluation
    steps = [m["step"] for m in _jsonl(run / "metrics.jsonl")]
    assert steps == [0, 1, 2, 2, 3, 4, 4], steps
    assert (run / "checkpoints" / "step-4" / "model.safetensors").is_file()
