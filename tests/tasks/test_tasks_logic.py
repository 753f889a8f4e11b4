"""The logic task and the reasoning_gym reward (skipped without the reasoning-gym package)."""

from __future__ import annotations

import itertools

import pytest

rg = pytest.importorskip(
    "reasoning_gym", reason="reasoning-gym is not installed (pip install reasoning-gym)"
)

from peergrade.rewards import resolve_reward  # noqa: E402
from peergrade.tasks import load_task  # noqa: E402


def take(it, n):
    return list(itertools.islice(it, n))


@pytest.fixture(scope="module")
def task():
    return load_task("logic", dataset="leg_counting", chunk=200)


def test_rows_determinism_and_disjoint(task):
    rows = take(task.train_rows(0), 150)
    assert rows == take(task.train_rows(0), 150)
    assert {"prompt", "answer", "question", "metadata"} <= set(rows[0])
    assert rows[0]["prompt"][-1]["content"].endswith("<answer></answer>.")
    ev = task.eval_rows(10)
    assert ev == task.eval_rows(10)
    assert {r["question"] for r in ev}.isdisjoint({r["question"] for r in rows})
    assert task.default_rewards == [("reasoning_gym", 1.0)]


def test_reasoning_gym_reward_uses_its_scorer(task):
    rows = task.eval_rows(3)
    fn = resolve_reward("reasoning_gym")
    completions = [
        f"<think>count</think><answer>{rows[0]['answer']}</answer>",
        f"<answer>{int(rows[1]['answer']) + 1}</answer>",
        f"<answer>{rows[2]['answer']}</answer><answer>{rows[2]['answer']}</answer>",
    ]
    cols = {k: [r[k] for r in rows] for k in ("answer", "metadata", "question")}
    assert fn(["p"] * 3, completions, **cols) == [1.0, 0.0, 0.0]


def test_bad_dataset_names_closest():
    with pytest.raises(ValueError, match="did you mean 'leg_counting'"):
        load_task("logic", dataset="leg_countin")
    with pytest.raises(ValueError, match="could not create"):
        load_task("logic", dataset="leg_counting", dataset_options={"no_such_option": 3})
