"""``format``: R1 think/answer structure, strict and lenient, empty-tag guard."""

from __future__ import annotations

import pytest

from peergrade.rewards.format import format_reward

GOOD = "<think>6 times 7</think><answer>42</answer>"

CASES = [
    # (completion, mode, strict expected, lenient expected)
    (GOOD, 1.0, 1.0),
    ("  <think>\nx\n</think>\n<answer>\n42\n</answer>\n", 1.0, 1.0),
    ("Sure! " + GOOD, 0.0, 1.0),
    (GOOD + " Hope this helps.", 0.0, 1.0),
    ("<think>a</think> so <answer>1</answer>", 0.0, 1.0),
    ("<answer>42</answer>", 0.0, 0.0),
    ("<think>x</think>", 0.0, 0.0),
    ("42", 0.0, 0.0),
    ("", 0.0, 0.0),
    # empty tags cannot be farmed
    ("<think></think><answer></answer>", 0.0, 0.0),
    ("<think> \n </think><answer>42</answer>", 0.0, 0.0),
    ("<think>x</think><answer>  </answer>", 0.0, 0.0),
    # repeated, reordered, nested, unclosed
    (GOOD + GOOD, 0.0, 0.0),
    ("<think>a</think><think>b</think><answer>1</answer>", 0.0, 0.0),
    ("<answer>1</answer><think>a</think>", 0.0, 0.0),
    ("<think>a<answer>1</answer></think>", 0.0, 0.0),
    ("<think>a</think><answer>1", 0.0, 0.0),
    ("</think>a<think><answer>1</answer>", 0.0, 0.0),
]


@pytest.mark.parametrize("completion, strict, lenient", CASES)
def test_format_table(completion, strict, lenient):
    assert format_reward(["p"], [completion], mode="strict") == [strict]
    assert format_reward(["p"], [completion], mode="lenient") == [lenient]


def test_think_in_prompt():
    assert format_reward(["p"], ["x</think><answer>1</answer>"], think_in_prompt=True) == [1.0]
    assert format_reward(["p"], [GOOD], think_in_prompt=True) == [0.0]


def test_chat_messages_and_bad_mode():
    assert format_reward(["p"], [[{"role": "assistant", "content": GOOD}]]) == [1.0]
    with pytest.raises(ValueError, match="'strict' or 'lenient'"):
        format_reward(["p"], [GOOD], mode="loose")
