"""The countdown task: every generated solution verifies, determinism, disjoint splits."""

from __future__ import annotations

import itertools

import pytest

from peergrade.rewards.countdown import countdown
from peergrade.tasks import load_task
from peergrade.tasks.countdown import is_eval_problem


def take(it, n):
    return list(itertools.islice(it, n))


def test_generated_solutions_score_one_and_respect_ranges():
    task = load_task("countdown", min_numbers=3, max_numbers=5, max_number=20, max_target=50)
    rows = take(task.train_rows(0), 500)
    scores = countdown(
        [r["prompt"] for r in rows],
        [f"<answer>{r['answer']}</answer>" for r in rows],
        target=[r["target"] for r in rows],
        numbers=[r["numbers"] for r in rows],
    )
    assert scores == [1.0] * len(rows)
    for r in rows:
        assert 3 <= len(r["numbers"]) <= 5 and all(1 <= x <= 20 for x in r["numbers"])
        assert 1 <= r["target"] <= 50
        (msg,) = r["prompt"]  # one user message
        assert msg["role"] == "user"
        assert str(r["numbers"]) in msg["content"] and str(r["target"]) in msg["content"]
    assert task.default_rewards == [("countdown", 1.0)]


def test_determinism_and_disjoint_splits():
    t = load_task("countdown")
    assert take(t.train_rows(1), 30) == take(load_task("countdown").train_rows(1), 30)
    assert take(t.train_rows(1), 30) != take(t.train_rows(2), 30)
    train = {(tuple(sorted(r["numbers"])), r["target"]) for r in take(t.train_rows(0), 3000)}
    ev = t.eval_rows(100)
    assert ev == t.eval_rows(100)
    ev_keys = {(tuple(sorted(r["numbers"])), r["target"]) for r in ev}
    assert len(ev_keys) == 100 and train.isdisjoint(ev_keys)
    assert all(is_eval_problem(*k) for k in ev_keys)


def test_system_prompt_makes_messages():
    row = take(load_task("countdown", system_prompt="Be brief.").train_rows(0), 1)[0]
    assert row["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert row["prompt"][1]["role"] == "user"


@pytest.mark.parametrize(
    "opts, match",
    [
        ({"min_numbers": 1}, "min_numbers"),
        ({"min_numbers": 4, "max_numbers": 3}, "max_numbers"),
        ({"template": "{nums}"}, "template"),
    ],
)
def test_bad_options(opts, match):
    with pytest.raises(ValueError, match=match):
        load_task("countdown", **opts)
