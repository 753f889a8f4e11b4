"""The examples under examples/, run as a user runs them: from the command line, from their
own config file, on the bundled tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peergrade.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def metrics(run_dir: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if "rollout/frac_zero_std_groups" in m]


@pytest.mark.slow
def test_guess_the_number_trains_from_the_command_line_with_signal_in_its_groups(
    tmp_path, monkeypatch, capsys
):
    """Three steps of examples/guess_number from any working directory. Its groups must carry
    learning signal: a group whose 4 episodes all score the same has zero advantages. Over 30
    steps of this config (seed 0) the fraction of such groups was 0.26 on average (0.06 to 0.56
    per step of 16 groups), so a mean above 0.5 over the first steps means the feedback or the
    reward broke (a reward that never varies gives 1.0)."""
    monkeypatch.chdir(tmp_path)  # paths in the config are relative to the config file
    rc = main(
        ["train", "--config", str(EXAMPLES / "guess_number" / "config.yaml"), "-o", "run"]
        + ["--steps", "3", "--train.display", "none", "--train.eval_size", "20"]
    )
    assert rc == 0, capsys.readouterr().err
    steps = metrics(tmp_path / "run")
    assert [m["step"] for m in steps] == [1, 2, 3]
    flat = [m["rollout/frac_zero_std_groups"] for m in steps]
    assert sum(flat) / len(flat) < 0.5, flat
    for m in steps:
        # episodes end on a right guess or after 3 guesses, some of each
        assert 0 < m["episode/stop_reason/solved"] < 1, m
        assert m["episode/stop_reason/solved"] + m.get("episode/stop_reason/max_turns", 0) > 0.9
        assert 1 <= m["turns/mean"] <= 3
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    advantages = [a for s in samples for a in s["advantages"]]
    assert any(a != 0 for a in advantages), advantages  # the logged groups learn too
    feedback = {
        m["content"] for s in samples for c in s["completions"] for m in c if m["role"] == "user"
    }
    assert feedback <= {"higher", "lower", "a number please"} and feedback & {"higher", "lower"}
