"""The arithmetic task: determinism, disjoint splits, difficulty, templates, bad options."""

from __future__ import annotations

import itertools

import pytest

from peergrade.tasks import load_task
from peergrade.tasks.arithmetic import (
    INSTRUCT_TEMPLATE,
    ArithmeticTask,
    is_eval_problem,
    solve,
)


def take(it, n):
    return list(itertools.islice(it, n))


def test_rows_shape_and_answers_are_exact():
    task = load_task("arithmetic")
    assert task.name == "arithmetic"
    assert task.default_rewards == [("arithmetic", 1.0)]
    assert set(task.columns) == {"answer", "a", "b", "op"}
    for row in take(task.train_rows(0), 300):
        assert set(row) == {"prompt", "answer", "a", "b", "op"}
        a, b, op = row["a"], row["b"], row["op"]
        # independent re-computation (not via solve)
        expected = {"+": a + b, "-": a - b, "*": a * b}[op]
        assert row["answer"] == str(expected)
        assert row["prompt"] == [{"role": "user", "content": f"{a}{op}{b}="}]
        assert 0 <= a <= 99 and 0 <= b <= 99


def test_solve_hand_values():
    assert solve(12, "+", 30) == 42
    assert solve(3, "-", 15) == -12
    assert solve(12, "*", 12) == 144
    with pytest.raises(ValueError, match="'\\+', '-', '\\*'"):
        solve(1, "/", 2)


def test_train_stream_is_deterministic_per_seed():
    t = ArithmeticTask()
    assert take(t.train_rows(3), 50) == take(ArithmeticTask().train_rows(3), 50)
    assert take(t.train_rows(3), 50) != take(t.train_rows(4), 50)


def test_eval_rows_deterministic_distinct_and_held_out():
    t = ArithmeticTask()
    ev = t.eval_rows(200, seed=0)
    assert ev == ArithmeticTask().eval_rows(200, seed=0)
    keys = [(r["a"], r["op"], r["b"]) for r in ev]
    assert len(set(keys)) == 200
    assert all(is_eval_problem(*k) for k in keys)
    assert ev != t.eval_rows(200, seed=1)


def test_train_and_eval_are_disjoint():
    t = ArithmeticTask(
        min_digits=1, max_digits=1, ops="+-*"
    )  # small space: collisions would show up
    train_keys = {(r["a"], r["op"], r["b"]) for r in take(t.train_rows(0), 5000)}
    eval_keys = {(r["a"], r["op"], r["b"]) for r in t.eval_rows(20)}
    assert train_keys.isdisjoint(eval_keys)
    assert not any(is_eval_problem(*k) for k in train_keys)
    # the split holds out roughly a tenth of all problems
    space = [(a, op, b) for a in range(10) for b in range(10) for op in "+-*"]
    frac = sum(is_eval_problem(*p) for p in space) / len(space)
    assert 0.05 < frac < 0.15


def test_non_negative_by_default_and_negatives_when_allowed():
    rows = take(ArithmeticTask(ops="-").train_rows(0), 500)
    assert all(int(r["answer"]) >= 0 and r["a"] >= r["b"] for r in rows)
    rows = take(ArithmeticTask(ops="-", allow_negative=True).train_rows(0), 500)
    assert any(int(r["answer"]) < 0 for r in rows)


def test_difficulty_ranges_and_ops():
    rows = take(ArithmeticTask(min_digits=3, max_digits=4, ops="*").train_rows(1), 300)
    assert all(100 <= r["a"] <= 9999 and 100 <= r["b"] <= 9999 for r in rows)
    assert {r["op"] for r in rows} == {"*"}
    assert any(r["a"] >= 1000 for r in rows) and any(r["a"] < 1000 for r in rows)
    rows = take(ArithmeticTask(ops="+-").train_rows(1), 300)
    assert {r["op"] for r in rows} == {"+", "-"}


def test_instruct_template():
    t = ArithmeticTask(template=INSTRUCT_TEMPLATE)
    row = take(t.train_rows(0), 1)[0]
    assert (
        row["prompt"][0]["content"]
        == f"What is {row['a']} {row['op']} {row['b']}? Put the final number inside <answer></answer>."
    )


@pytest.mark.parametrize(
    "opts, match",
    [
        ({"min_digits": 0}, "min_digits"),
        ({"min_digits": 3, "max_digits": 2}, "max_digits"),
        ({"ops": "+/"}, "ops"),
        ({"ops": ""}, "ops"),
        ({"template": "{x}+{b}"}, "template"),
        ({"colour": "red"}, "no option .colour.; its options are min_digits"),
    ],
)
def test_bad_options_name_the_option(opts, match):
    with pytest.raises(ValueError, match=match):
        load_task("arithmetic", **opts)


def test_too_many_eval_rows_is_a_clear_error():
    with pytest.raises(ValueError, match="held-out problems"):
        ArithmeticTask(min_digits=1, max_digits=1).eval_rows(1000)


def test_unknown_task_suggests_closest():
    with pytest.raises(ValueError, match="did you mean 'arithmetic'") as ei:
        load_task("arithmetc")
    assert "countdown" in str(ei.value)
