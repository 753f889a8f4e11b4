"""``format`` mode ``answer_only``: one final, non-empty ``<answer>`` block (instruct models)."""

from __future__ import annotations

import pytest

from peergrade.rewards.format import format_reward, is_well_formed

CASES = [
    # (completion, expected)
    ("<answer>47</answer>", 1.0),
    ("12 + 35 = 47. <answer>47</answer>", 1.0),
    ("12 + 35 = 47.\n<answer>\n47\n</answer>\n  ", 1.0),
    ("<think>12+35</think><answer>47</answer>", 1.0),  # think tags neither needed nor refused
    ("<answer>not a number</answer>", 1.0),  # the format says nothing about correctness
    # no block, empty block, text after the block
    ("47", 0.0),
    ("", 0.0),
    ("<answer></answer>", 0.0),
    ("so <answer> \n </answer>", 0.0),
    ("<answer>47</answer>.", 0.0),
    ("<answer>47</answer> Hope this helps!", 0.0),
    # repeated, reversed, unclosed, unopened
    ("<answer>47</answer><answer>47</answer>", 0.0),
    ("<answer>46</answer> no, <answer>47</answer>", 0.0),
    ("</answer>47<answer>", 0.0),
    ("<answer>47", 0.0),
    ("47</answer>", 0.0),
    ("<answer><answer>47</answer>", 0.0),
]


@pytest.mark.parametrize("completion, expected", CASES)
def test_answer_only_table(completion, expected):
    assert format_reward(["p"], [completion], mode="answer_only") == [expected]
    assert is_well_formed(completion, "answer_only") is (expected == 1.0)


def test_answer_only_differs_from_r1_modes():
    text = "12 + 35 = 47. <answer>47</answer>"
    assert format_reward(["p"] * 3, [text] * 3, mode="answer_only") == [1.0, 1.0, 1.0]
    assert format_reward(["p"], [text], mode="strict") == [0.0]
    assert format_reward(["p"], [text], mode="lenient") == [0.0]


def test_answer_only_chat_message_and_bad_mode():
    msg = [{"role": "assistant", "content": "<answer>3</answer>"}]
    assert format_reward(["p"], [msg], mode="answer_only") == [1.0]
    with pytest.raises(ValueError, match="'answer_only', 'strict' or 'lenient'"):
        format_reward(["p"], ["x"], mode="answer")
    with pytest.raises(ValueError, match="'answer_only', 'strict' or 'lenient'"):
        is_well_formed("x", "answers")
