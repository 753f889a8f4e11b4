"""Reward resolution (built-in, module:function, file.py:function) and score_rewards policies."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from peergrade.rewards import (
    BUILTIN_REWARDS,
    RewardError,
    RewardSpec,
    make_reward_spec,
    resolve_reward,
    score_rewards,
)

# ---------------------------------------------------------------- resolution


def test_every_builtin_name_resolves_or_says_why():
    for name in BUILTIN_REWARDS:
        try:
            fn = resolve_reward(name)
        except ImportError as exc:  # an optional module not landed/installed: a clear message
            assert name in str(exc) and "not available" in str(exc)
        else:
            assert callable(fn)


def test_module_function_form():
    fn = resolve_reward("peergrade.rewards.math:arithmetic")
    from peergrade.rewards.math import arithmetic

    assert fn is arithmetic


def test_file_form_with_trl_style_function(tmp_path):
    f = tmp_path / "my_rewards.py"
    f.write_text(
        textwrap.dedent(
            """
            def my_fn(completions, **kwargs):
                return [float(len(c)) for c in completions]
            CONSTANT = 3
            """
        )
    )
    fn = resolve_reward(f"{f}:my_fn")
    assert fn(prompts=["p"], completions=["abc"]) == [3.0]
    # loading twice gives the same module (no re-execution surprises)
    assert resolve_reward(f"{f}:my_fn") is fn
    with pytest.raises(ValueError, match="no attribute 'my_fm'.*did you mean 'my_fn'"):
        resolve_reward(f"{f}:my_fm")
    with pytest.raises(ValueError, match="'CONSTANT' is a int, not a callable"):
        resolve_reward(f"{f}:CONSTANT")
    with pytest.raises(ValueError, match="does not exist"):
        resolve_reward(f"{tmp_path}/missing.py:my_fn")


def test_file_that_fails_to_import(tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(ImportError, match="boom at import"):
        resolve_reward(f"{f}:fn")


def test_unknown_builtin_lists_names_and_closest():
    with pytest.raises(ValueError) as ei:
        resolve_reward("math_acuracy")
    msg = str(ei.value)
    assert "did you mean 'math_accuracy'" in msg
    for name in ("arithmetic", "format", "countdown", "code_tests"):
        assert name in msg


def test_missing_module_and_attr():
    with pytest.raises(ValueError, match="cannot be imported"):
        resolve_reward("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        resolve_reward("peergrade.rewards.math:nope")


def test_code_tests_is_registered_lazily():
    assert BUILTIN_REWARDS["code_tests"] == "peergrade.rewards.code:code_tests"


def test_make_reward_spec_names_and_kwargs():
    s = make_reward_spec("arithmetic", weight=2.0, kwargs={"extract": "tag"})
    assert s.name == "arithmetic" and s.weight == 2.0 and s.kwargs == {"extract": "tag"}
    # kwargs are bound: "42" without a tag scores 0 under extract="tag"
    assert s.bound(prompts=["p"], completions=["42"], answer=["42"]) == [0.0]
    s2 = make_reward_spec(lambda prompts, completions, **kw: [1.0] * len(completions))
    assert s2.name == "<lambda>"
    with pytest.raises(ValueError, match="weight must be finite"):
        RewardSpec("x", lambda **k: [], weight=float("inf"))


# ---------------------------------------------------------------- scoring


def const(value):
    def fn(prompts, completions, **kw):
        return [value] * len(completions)

    return fn


def echo_answer(prompts, completions, answer, **kw):
    return [a for a in answer]


def raises_on_x(prompts, completions, **kw):
    out = []
    for c in completions:
        if c == "x":
            raise KeyError("bad sample")
        out.append(1.0)
    return out


P = ["p"] * 4
C = ["a", "b", "x", "d"]


def test_weighted_total_and_none_handling():
    specs = [
        RewardSpec("acc", echo_answer, weight=1.0),
        RewardSpec("fmt", lambda prompts, completions, **k: [0.5, None, None, 0.25], weight=0.5),
        RewardSpec("na", const(None), weight=3.0),
    ]
    scores = score_rewards(specs, P, C, {"answer": [1.0, None, 0.0, 2.0]})
    assert torch.equal(scores.per_fn["acc"][[0, 2, 3]], torch.tensor([1.0, 0.0, 2.0]))
    assert math.isnan(scores.per_fn["acc"][1])
    assert torch.isnan(scores.per_fn["na"]).all()
    # total: 1 + 0.5*0.5 ; NaN (nobody scored sample 1) ; 0 ; 2 + 0.5*0.25
    expected = torch.tensor([1.25, float("nan"), 0.0, 2.125])
    assert torch.allclose(scores.total, expected, equal_nan=True)
    m = scores.metrics()
    assert m["reward/acc/mean"] == pytest.approx(1.0)
    # ddof 1 over the scored samples only, as TRL's nanstd
    assert m["reward/acc/std"] == pytest.approx(math.sqrt(((0 - 1) ** 2 + 0 + (2 - 1) ** 2) / 2))
    assert m["reward/fmt/mean"] == pytest.approx(0.375)
    assert "reward/na/mean" not in m
    assert m["reward/total/mean"] == pytest.approx((1.25 + 0 + 2.125) / 3)
    # the unscored sample 1 is not counted as a 0
    assert m["reward/total/std"] == pytest.approx(torch.tensor([1.25, 0.0, 2.125]).std().item())
    assert "reward/fmt/std" in m and "reward/na/std" not in m
    assert m["reward/errors"] == 0.0
    assert scores.num_errors == 0 and scores.errors == []


def test_columns_and_completion_ids_are_passed_by_keyword():
    seen = {}

    def spy(prompts, completions, completion_ids, answer, **kw):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, answer=answer)
        seen["extra"] = sorted(kw)
        return [0.0] * len(completions)

    score_rewards(
        [RewardSpec("spy", spy, kwargs={"scale": 2})],
        ["p1", "p2"],
        ["c1", "c2"],
        {"answer": ["1", "2"], "completion_ids": [[1, 2], [3]], "tests": ["t1", "t2"]},
    )
    assert seen["ids"] == [[1, 2], [3]] and seen["answer"] == ["1", "2"]
    assert seen["extra"] == ["log_extra", "log_metric", "scale", "tests", "trainer_state"]


def test_config_kwarg_wins_over_column():
    def fn(prompts, completions, mode, **kw):
        return [1.0 if mode == "cfg" else 0.0] * len(completions)

    s = score_rewards(
        [RewardSpec("f", fn, kwargs={"mode": "cfg"})], ["p"], ["c"], {"mode": ["col"]}
    )
    assert s.per_fn["f"].tolist() == [1.0]


@pytest.mark.parametrize(
    "fn, pattern, n_bad",
    [
        (raises_on_x, r"raised on the batch of 4 \(first failing sample index 2: KeyError", 4),
        (lambda prompts, completions, **k: [1.0] * 3, "returned 3 scores for 4", 4),
        (lambda prompts, completions, **k: [1.0] * 5, "returned 5 scores for 4", 4),
        (lambda prompts, completions, **k: 1.0, "returned a float, expected a list", 4),
        (lambda prompts, completions, **k: torch.ones(4), "returned a Tensor", 4),
        (
            lambda prompts, completions, **k: [1.0, float("nan"), 1.0, 1.0],
            "sample 1: non-finite",
            1,
        ),
        (
            lambda prompts, completions, **k: [1.0, 1.0, float("inf"), float("-inf")],
            "sample 2: non-finite",
            2,
        ),
        (lambda prompts, completions, **k: [1.0, "1", 1.0, 1.0], "sample 1: '1' \\(str\\)", 1),
        (  # finite in float64, inf in the float32 reward tensors
            lambda prompts, completions, **k: [1.0, 1e300, 1.0, -1e300],
            r"'bad' sample 1: score 1e\+300 is outside the float32 range",
            2,
        ),
        (lambda prompts, completions, **k: [3.5e38, 1.0, 1.0, 1.0], "sample 0: score 3.5e", 1),
    ],
)
def test_error_policies(fn, pattern, n_bad):
    specs = [RewardSpec("bad", fn), RewardSpec("good", const(0.5))]
    with pytest.raises(RewardError, match=pattern):
        score_rewards(specs, P, C, on_error="fail")
    scores = score_rewards(specs, P, C, on_error="zero")
    assert scores.num_errors == n_bad
    assert len(scores.errors) >= 1 and "'bad'" in scores.errors[0]
    bad = scores.per_fn["bad"]
    assert not torch.isnan(bad).any()
    assert int((bad == 0).sum()) >= n_bad
    assert torch.equal(scores.per_fn["good"], torch.full((4,), 0.5))
    assert scores.metrics()["reward/errors"] == float(n_bad)


def test_float32_range_edge_and_weighted_total_overflow():
    from peergrade.algo import group_advantages
    from peergrade.rewards.registry import FLOAT32_MAX

    big = [RewardSpec("a", const(FLOAT32_MAX)), RewardSpec("b", const(-1.0))]
    s = score_rewards(big, P, C)  # the largest float32 itself is a valid score
    assert torch.isfinite(s.total).all() and s.num_errors == 0
    # each score in range, the weighted sum not: same policy, the sample is named
    over = [RewardSpec("a", const(3e38)), RewardSpec("b", const(1e38), weight=2.0)]
    with pytest.raises(RewardError, match="weighted reward total of sample 0: 5e"):
        score_rewards(over, P, C, on_error="fail")
    s = score_rewards(over, P, C, on_error="zero")
    assert s.total.tolist() == [0.0] * 4
    assert s.num_errors == 4 and "float32" in s.errors[0]
    assert all(math.isfinite(v) for v in s.metrics().values())
    # what the trainer does next with the totals no longer meets an inf
    assert torch.isfinite(group_advantages(s.total.view(2, 2))).all()


def test_zero_policy_keeps_valid_scores_of_partially_bad_list():
    fn = lambda prompts, completions, **k: [0.7, float("nan"), None, 0.2]  # noqa: E731
    s = score_rewards([RewardSpec("f", fn)], P, C, on_error="zero")
    assert torch.allclose(
        s.per_fn["f"], torch.tensor([0.7, 0.0, float("nan"), 0.2]), equal_nan=True
    )
    assert s.num_errors == 1


def test_numpy_and_bool_scores_are_accepted():
    import numpy as np

    fn = lambda prompts, completions, **k: [np.float32(0.5), True, np.int64(2), None]  # noqa: E731
    s = score_rewards([RewardSpec("f", fn)], P, C)
    assert torch.allclose(
        s.per_fn["f"], torch.tensor([0.5, 1.0, 2.0, float("nan")]), equal_nan=True
    )


def test_input_validation():
    with pytest.raises(ValueError, match="on_error='ignore'"):
        score_rewards([], P, C, on_error="ignore")
    with pytest.raises(ValueError, match="column 'answer' has 3 entries, expected 4"):
        score_rewards([RewardSpec("f", const(1.0))], P, C, {"answer": [1, 2, 3]})
    with pytest.raises(ValueError, match="3 prompts but 4 completions"):
        score_rewards([RewardSpec("f", const(1.0))], P[:3], C)
    with pytest.raises(ValueError, match="unique"):
        score_rewards([RewardSpec("f", const(1.0)), RewardSpec("f", const(0.0))], P, C)


def test_exception_in_batch_only_reports_unknown_sample():
    def batch_only(prompts, completions, **kw):
        if len(completions) > 1:
            raise ValueError("batch too big")
        return [1.0]

    with pytest.raises(RewardError) as ei:
        score_rewards([RewardSpec("b", batch_only)], P, C)
    assert "batch too big" in str(ei.value) and "first failing sample" not in str(ei.value)


def test_partial_failures_keep_the_other_scores_and_are_counted_by_kind(capsys):
    """RewardSampleErrors: the samples that failed go through on_error, the others keep their
    scores, and the failures are counted under reward/<fn>/<kind> (0 when declared and none)."""
    from peergrade.monitoring.metrics import Display
    from peergrade.rewards import RewardSampleErrors

    def flaky(prompts, completions, **kw):
        raise RewardSampleErrors("1 of 3 failed", [0.5, None, 1.0], {1: "boom"}, kind="x_errors")

    flaky.error_metrics = ("x_errors",)
    spec = RewardSpec(name="flaky", fn=flaky)
    scores = score_rewards([spec], ["p"] * 3, ["a", "b", "c"], on_error="zero")
    assert scores.per_fn["flaky"].tolist() == [0.5, 0.0, 1.0]
    m = scores.metrics()
    assert m["reward/flaky/x_errors"] == 1.0 and m["reward/errors"] == 1.0
    assert scores.errors == ["reward 'flaky' sample 1: boom"]
    with pytest.raises(RewardError, match="sample 1: boom"):
        score_rewards([spec], ["p"] * 3, ["a", "b", "c"], on_error="fail")

    def fine(prompts, completions, **kw):
        return [1.0] * len(completions)

    fine.error_metrics = ("x_errors",)
    ok = score_rewards([RewardSpec(name="fine", fn=fine)], ["p"], ["a"]).metrics()
    assert ok["reward/fine/x_errors"] == 0.0

    display = Display("plain", total_steps=2)
    display.update(1, {**m, "reward/flaky/sandbox_errors": 1.0})
    display.update(2, ok)
    lines = capsys.readouterr().out.splitlines()
    assert "reward errors 1 (sandbox 1)" in lines[0] and "errors" not in lines[1]


def test_misspelt_builtin_option_is_rejected_with_did_you_mean():
    """Built-ins take the dataset columns as **_columns, so a typo used to be accepted and
    ignored in training; every spec now checks its options where it is built."""
    from peergrade.rewards import make_reward_specs

    with pytest.raises(ValueError, match=r"no option 'extrct' \(did you mean 'extract'\?\)"):
        make_reward_specs([("arithmetic", 1.0, {"extrct": "last_number"})])
    with pytest.raises(ValueError, match=r"'moed' \(did you mean 'mode'\?\).*options: mode"):
        make_reward_specs([("format", 1.0, {"moed": "strict"})])
    (spec,) = make_reward_specs([("arithmetic", 1.0, {"extract": "last_number"})])
    assert spec.kwargs == {"extract": "last_number"}


def test_user_function_with_kwargs_may_take_any_option():
    from peergrade.rewards import RewardSpec

    def mine(prompts, completions, *, scale=1.0, **kwargs):
        return [scale * kwargs.get("bonus", 0.0) for _ in completions]

    def strict(prompts, completions, *, scale=1.0):
        return [scale for _ in completions]

    assert RewardSpec("mine", mine, kwargs={"bonus": 2.0}).kwargs == {"bonus": 2.0}
    with pytest.raises(ValueError, match=r"no option 'scal' \(did you mean 'scale'\?\)"):
        RewardSpec("strict", strict, kwargs={"scal": 2.0})
