"""The ``arithmetic`` reward: table-driven correct / wrong / malformed / adversarial cases."""

from __future__ import annotations

import pytest

from peergrade.rewards import resolve_reward
from peergrade.rewards.extract import parse_int
from peergrade.rewards.math import arithmetic, extract_integer

CASES = [
    # (completion, answer, extract, expected reward)
    ("42", "42", "auto", 1.0),
    ("  42\n", "42", "auto", 1.0),
    ("-12", "-12", "auto", 1.0),
    ("\u221212", "-12", "auto", 1.0),  # unicode minus
    ("+7", "7", "auto", 1.0),
    ("1,234", "1234", "auto", 1.0),
    ("1234", "1,234", "auto", 1.0),
    ("007", "7", "auto", 1.0),
    ("43", "42", "auto", 0.0),
    ("", "0", "auto", 0.0),
    ("forty-two", "42", "auto", 0.0),
    ("42.0", "42", "auto", 0.0),
    ("12,34", "1234", "auto", 0.0),  # bad grouping reads as a list
    ("<think>6*7</think><answer>42</answer>", "42", "auto", 1.0),
    ("<answer> 42 </answer>", "42", "auto", 1.0),
    ("<answer>41</answer>", "42", "auto", 0.0),
    # adversarial: several answers
    ("<answer>42</answer><answer>42</answer>", "42", "auto", 0.0),
    ("<answer>41</answer><answer>42</answer>", "42", "auto", 0.0),
    ("<answer>41 42</answer>", "42", "auto", 0.0),
    ("<answer>41, 42</answer>", "42", "auto", 0.0),
    ("<answer>[41, 42]</answer>", "42", "auto", 0.0),
    ("41 42", "42", "auto", 0.0),
    ("42 42", "42", "auto", 0.0),
    ("42\n43", "42", "auto", 0.0),
    # malformed tags: auto does not fall back to the whole text
    ("<answer>42", "42", "auto", 0.0),
    ("42</answer>", "42", "auto", 0.0),
    ("</answer>42<answer>", "42", "auto", 0.0),
    # extract modes
    ("42", "42", "tag", 0.0),
    ("<answer>42</answer>", "42", "tag", 1.0),
    ("<answer>42</answer>", "42", "whole", 0.0),
    ("So 6*7 = 42", "42", "last_number", 1.0),
    ("So 6*7 = 42.5", "42", "last_number", 0.0),
    ("the sum is 1,234.", "1234", "last_number", 1.0),
    ("no digits", "42", "last_number", 0.0),
    ("42", 42, "auto", 1.0),  # integer reference
]


@pytest.mark.parametrize("completion, answer, extract, expected", CASES)
def test_arithmetic_table(completion, answer, extract, expected):
    assert arithmetic(["p"], [completion], answer=[answer], extract=extract) == [expected]


def test_chat_message_completions():
    msgs = [
        [{"role": "assistant", "content": "<answer>9</answer>"}],
        [{"role": "assistant", "content": [{"type": "text", "text": "10"}]}],
    ]
    assert arithmetic(["p", "q"], msgs, answer=["9", "9"]) == [1.0, 0.0]


def test_batch_and_extra_columns_ignored():
    out = arithmetic(
        ["a", "b", "c"],
        ["1", "2", "x"],
        answer=["1", "3", "3"],
        a=[0, 0, 0],
        completion_ids=[[1]] * 3,
    )
    assert out == [1.0, 0.0, 0.0]


def test_resolves_by_name():
    assert resolve_reward("arithmetic") is arithmetic


def test_errors():
    with pytest.raises(ValueError, match="'answer' column"):
        arithmetic(["p"], ["1"])
    with pytest.raises(ValueError, match="not an integer"):
        arithmetic(["p"], ["1"], answer=["one"])
    with pytest.raises(ValueError, match="'auto', 'tag', 'whole', 'last_number'"):
        extract_integer("1", "boxed-ish")
    with pytest.raises(TypeError, match="completion must be a string"):
        arithmetic(["p"], [3], answer=["3"])


@pytest.mark.parametrize(
    "text, value",
    [
        ("0", 0),
        ("-0", 0),
        ("12", 12),
        ("-1,234,567", -1234567),
        ("1,2", None),
        ("1 2", None),
        ("", None),
        ("1e3", None),
        ("0x10", None),
        ("١٢", None),
    ],
)
def test_parse_int(text, value):
    assert parse_int(text) == value
