"""``math_accuracy``: extraction rules, equivalence, guards, and the per-check time limit."""

from __future__ import annotations

import threading
import time

import pytest

from peergrade.rewards.math import extract_math_answer, is_equivalent, math_accuracy

CASES = [
    # (completion, reference, kwargs, expected)
    ("The answer is \\boxed{72}.", "72", {}, 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", {}, 1.0),
    ("\\boxed{0.5}", "\\frac12", {}, 1.0),
    ("<answer>\\{2, 1\\}</answer>", "\\{1,2\\}", {}, 1.0),
    ("<answer>(0, 1]</answer>", "(0,1]", {}, 1.0),
    ("<answer>x = 4</answer>", "4", {}, 1.0),
    ("<answer>1,234</answer>", "1234", {}, 1.0),
    ("<answer>\\sqrt{4}</answer>", "2", {}, 1.0),
    ("<answer>(x+1)^2</answer>", "x^2+2x+1", {}, 1.0),
    ("so she pays 18 dollars", "18", {}, 1.0),  # auto falls back to the last number
    ("\\boxed{71}", "72", {}, 0.0),
    ("<answer>five</answer>", "5", {}, 0.0),
    ("", "5", {}, 0.0),
    ("no number here", "5", {}, 0.0),
    ("<answer></answer> 5", "5", {}, 0.0),  # empty tag, no fallback
    ("<answer>5", "5", {}, 0.0),  # unclosed tag, no fallback
    # adversarial: several answers
    ("<answer>3</answer><answer>4</answer>", "4", {}, 0.0),
    ("<answer>4</answer><answer>4</answer>", "4", {}, 0.0),
    ("<answer>3 or 4</answer>", "4", {}, 0.0),
    ("<answer>3, 4</answer>", "4", {}, 0.0),
    ("\\boxed{3} or maybe \\boxed{4}", "4", {}, 0.0),
    ("\\boxed{4} so \\boxed{4}", "4", {}, 1.0),  # restating the same box is fine
    ("\\boxed{3} or maybe \\boxed{4}", "4", {"allow_multiple_boxed": True}, 1.0),
    ("\\boxed{4", "4", {}, 0.0),  # unbalanced box
    # extraction rule switches
    ("so 4", "4", {"extract": "boxed"}, 0.0),
    ("\\boxed{4}", "4", {"extract": "tag"}, 0.0),
    ("<answer>4</answer> then 5", "5", {"extract": "last_number"}, 1.0),
    ("  3/4 ", "0.75", {"extract": "whole"}, 1.0),
]


@pytest.mark.parametrize("completion, ref, kwargs, expected", CASES)
def test_math_accuracy_table(completion, ref, kwargs, expected):
    assert math_accuracy(["p"], [completion], answer=[ref], **kwargs) == [expected]


def test_chat_completion_and_none_reference():
    comp = [[{"role": "assistant", "content": "\\boxed{2}"}]] * 2
    assert math_accuracy(["p", "q"], comp, answer=["2", None]) == [1.0, 0.0]


def test_bad_extract_and_missing_column():
    with pytest.raises(ValueError, match="'auto', 'tag', 'boxed', 'last_number', 'whole'"):
        extract_math_answer("1", "first")
    with pytest.raises(ValueError, match="'answer' column"):
        math_accuracy(["p"], ["1"])


def test_sympy_fallback_without_math_verify(monkeypatch):
    import peergrade.rewards.math as m

    monkeypatch.setattr(m, "_MV", False)  # as if math_verify were not installed
    # past the memo: verdicts memoised with math_verify would hide the fallback
    assert m._equivalent_uncached("\\frac{3}{4}", "0.75")
    assert m._equivalent_uncached("1,000", "1000")
    assert not m._equivalent_uncached("3/4", "0.7")
    assert not m._equivalent_uncached("__import__('os')", "0")


PATHOLOGICAL = "10^{10^{10^{10}}}!"


def test_pathological_expression_is_cut_off_in_main_thread():
    t0 = time.perf_counter()
    assert is_equivalent(PATHOLOGICAL, "2", timeout_s=0.5) is False
    assert time.perf_counter() - t0 < 3.0
    # the timer is cleared afterwards: a normal check still works
    assert is_equivalent("\\frac{1}{2}", "0.5", timeout_s=2.0)


@pytest.mark.slow
def test_pathological_expression_is_cut_off_off_the_main_thread():
    out = {}

    def work():
        t0 = time.perf_counter()
        out["ok"] = is_equivalent("\\frac{1}{2}", "0.5", timeout_s=2.0)  # starts the helper
        t1 = time.perf_counter()
        out["bad"] = is_equivalent(PATHOLOGICAL, "2", timeout_s=0.5)
        out["bad_s"] = time.perf_counter() - t1
        out["again"] = is_equivalent("3", "3.0", timeout_s=2.0)  # helper restarted
        out["first_s"] = t1 - t0

    th = threading.Thread(target=work)
    th.start()
    th.join(60)
    assert out["ok"] is True and out["bad"] is False and out["again"] is True
    assert out["bad_s"] < 3.0


# ------------------------------------------------------------------ memoised parses and verdicts


def _no_memo(monkeypatch):
    from peergrade.rewards import math as m

    monkeypatch.setattr(m._Memo, "get", lambda self, key, compute: compute())


def test_memo_leaves_the_audits_scores_unchanged(monkeypatch):
    """Every completion the audit battery gives math_accuracy scores the same with and without
    the memo, and so does the report (rows of the arithmetic task: numbers, words, lookalikes)."""
    import itertools

    from peergrade.rewards import RewardSpec
    from peergrade.rewards.audit import audit_rewards
    from peergrade.rewards.math import clear_caches
    from peergrade.tasks import load_task

    calls = []

    def recording(prompts, completions, answer=None, **columns):
        scores = math_accuracy(prompts, completions, answer=answer, **columns)
        calls.append((list(completions), list(answer), scores))
        return scores

    rows = list(itertools.islice(load_task("arithmetic").train_rows(0), 6))
    specs = [RewardSpec(name="math_accuracy", fn=recording, weight=1.0)]
    clear_caches()
    memoised = audit_rewards(specs, rows).to_dict()
    memoised.pop("seconds")
    assert len(calls) > 5 and sum(len(c) for c, _, _ in calls) > 100
    _no_memo(monkeypatch)
    for completions, answers, scores in calls:
        assert math_accuracy(None, completions, answer=answers) == scores
    calls.clear()
    plain = audit_rewards(specs, rows).to_dict()
    plain.pop("seconds")
    assert plain == memoised


def test_memo_keeps_nothing_from_a_check_past_its_limit():
    from peergrade.rewards import math as m

    m.clear_caches()
    assert is_equivalent(PATHOLOGICAL, "2", timeout_s=0.5) is False
    assert (PATHOLOGICAL, "2") not in m._VERDICTS.items
    assert is_equivalent("\\frac{1}{2}", "0.5", timeout_s=2.0)
    assert ("\\frac{1}{2}", "0.5") in m._VERDICTS.items  # a finished check is kept
