"""Penalties: hand-computed length, DAPO overlong, and repetition values."""

from __future__ import annotations

import pytest

from peergrade.rewards.penalties import length_penalty, overlong_penalty, repetition_penalty


def ids(*lengths):
    return [list(range(n)) for n in lengths]


def test_overlong_penalty_dapo_piecewise():
    # L_max = 10, L_cache = 4: free up to 6, linear to -1 at 10, -1 beyond
    out = overlong_penalty(
        ["p"] * 6, ["c"] * 6, completion_ids=ids(0, 6, 7, 8, 10, 11), max_length=10, cache_length=4
    )
    assert out == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0], abs=1e-12)


def test_overlong_penalty_errors():
    with pytest.raises(ValueError, match="max_length .* cache_length"):
        overlong_penalty(["p"], ["c"], completion_ids=ids(1))
    with pytest.raises(ValueError, match="0 < cache_length <= max_length"):
        overlong_penalty(["p"], ["c"], completion_ids=ids(1), max_length=4, cache_length=5)
    with pytest.raises(ValueError, match="'completion_ids' column"):
        overlong_penalty(["p"], ["c"], max_length=4, cache_length=2)
    with pytest.raises(ValueError, match="has 2 entries, expected 1"):
        overlong_penalty(["p"], ["c"], completion_ids=ids(1, 2), max_length=4, cache_length=2)


def test_length_penalty_tokens_and_chars():
    out = length_penalty(
        ["p"] * 3, ["a", "b", "c"], completion_ids=ids(0, 5, 30), max_length=20, scale=0.5
    )
    assert out == pytest.approx([0.0, -0.125, -0.5])
    assert length_penalty(["p"], ["abcd"], max_length=8) == pytest.approx([-0.5])
    with pytest.raises(ValueError, match="max_length > 0"):
        length_penalty(["p"], ["a"])


@pytest.mark.parametrize(
    "text, n, unit, expected",
    [
        ("the cat sat on the mat", 2, "words", 0.0),
        ("a b a b a b", 2, "words", -(1 - 2 / 5)),  # grams ab ba ab ba ab: 2 distinct of 5
        ("go go go go", 1, "words", -(1 - 1 / 4)),
        ("aaaa", 3, "chars", -(1 - 1 / 2)),
        ("one two", 3, "words", 0.0),  # shorter than n
        ("", 3, "words", 0.0),
    ],
)
def test_repetition_penalty_table(text, n, unit, expected):
    assert repetition_penalty(["p"], [text], n=n, unit=unit) == pytest.approx([expected])


def test_repetition_penalty_tokens_and_errors():
    out = repetition_penalty(
        ["p"], ["x"], completion_ids=[[1, 2, 1, 2, 1]], n=2, unit="tokens", scale=2.0
    )
    assert out == pytest.approx([-2.0 * (1 - 2 / 4)])
    with pytest.raises(ValueError, match="'words', 'chars' or 'tokens'"):
        repetition_penalty(["p"], ["x"], unit="bytes")
    with pytest.raises(ValueError, match="n >= 1"):
        repetition_penalty(["p"], ["x"], n=0)
