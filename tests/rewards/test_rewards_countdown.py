"""``countdown``: exact number use, exact value, ast whitelist, bounded work."""

from __future__ import annotations

import time

import pytest

from peergrade.rewards.countdown import check_equation, countdown

NUMS = [3, 5, 2]  # target 16 = (3 + 5) * 2

CASES = [
    ("(3 + 5) * 2", 16, NUMS, 1.0),
    ("2*(5+3)", 16, NUMS, 1.0),
    ("(3 + 5) * 2 = 16", 16, NUMS, 1.0),
    ("<answer>(3+5)*2</answer>", 16, NUMS, 1.0),
    ("<think>try</think>\n<answer> 2 * (3 + 5) </answer>", 16, NUMS, 1.0),
    ("(3 \u00d7 5) + 2 - 1", 16, [3, 5, 2, 1], 1.0),  # unicode times
    ("12 / 3 * 2 + 0", 8, [12, 3, 2, 0], 1.0),
    ("7 / 2 * 2", 7, [7, 2, 2], 1.0),  # exact fractions, 7/2 is not floored
    ("(3 + 5) * 2", 15, NUMS, 0.0),  # wrong value
    ("(3 + 5) * 2 = 15", 15, NUMS, 0.0),
    ("(3 + 5) * 2 = 17", 16, NUMS, 0.0),  # rhs is not the target
    ("3 + 5 + 2 = 16 = 16", 16, NUMS, 0.0),
    # guards on the numbers
    ("(3 + 5) * 2 * 1", 16, NUMS, 0.0),  # number not given
    ("(5 + 5) + 3 * 2", 16, NUMS, 0.0),  # reused number, missing none
    ("(3 + 5 + 5) + 3", 16, NUMS, 0.0),
    ("3 * 5 + 1", 16, [3, 5, 1, 2], 0.0),  # missing number (use_all)
    ("32 / 2", 16, [3, 2, 2], 0.0),  # glued digits
    # forbidden syntax
    ("-3 + 19", 16, [3, 19], 0.0),  # unary minus
    ("2 ** 4", 16, [2, 4], 0.0),
    ("9 ** 9 ** 9 ** 9", 0, [9, 9, 9, 9], 0.0),
    ("33 // 2", 16, [33, 2], 0.0),
    ("3.0 + 13", 16, [3, 13], 0.0),
    ("__import__('os').system('true')", 0, [], 0.0),
    ("abs(16)", 16, [16], 0.0),
    ("16 / (3 - 3)", 16, [16, 3, 3], 0.0),  # division by zero
    ("", 16, NUMS, 0.0),
    ("<answer>(3+5)*2</answer><answer>(3+5)*2</answer>", 16, NUMS, 0.0),  # two answers
    ("(3 + 5) * 2\n(5 + 3) * 2", 16, NUMS, 0.0),  # two equations
]


@pytest.mark.parametrize("completion, target, numbers, expected", CASES)
def test_countdown_table(completion, target, numbers, expected):
    assert countdown(["p"], [completion], target=[target], numbers=[numbers]) == [expected]


def test_use_all_false_allows_a_subset_but_no_reuse():
    assert countdown(["p"], ["3 * 5 + 1"], target=[16], numbers=[[3, 5, 1, 2]], use_all=False) == [
        1.0
    ]
    assert countdown(["p"], ["5 * 3 + 1"], target=[16], numbers=[[5, 1, 2]], use_all=False) == [0.0]


def test_huge_values_are_bounded():
    expr = "*".join(["99"] * 20)
    t0 = time.perf_counter()
    assert not check_equation(expr, 0, [99] * 20)
    assert check_equation("(" * 200 + "1" + ")" * 200, 1, [1])  # deep but valid
    assert not check_equation("(" * 3000 + "1" + ")" * 3000, 1, [1])  # too long
    assert not check_equation("1+" * 400 + "1", 401, [1] * 401)  # too long
    assert time.perf_counter() - t0 < 1.0


def test_bad_columns_and_extract():
    with pytest.raises(ValueError, match="'target' and 'numbers'"):
        countdown(["p"], ["1"])
    with pytest.raises(ValueError, match="'auto', 'tag' or 'whole'"):
        countdown(["p"], ["1"], target=[1], numbers=[[1]], extract="last")
