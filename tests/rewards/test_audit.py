"""``peergrade audit``: every exploit class is caught in a reward that falls for it, and the
built-in verifiers are not flagged on their own tasks (table-driven, no timing)."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import pytest

from peergrade.rewards import RewardSpec, make_reward_specs
from peergrade.rewards.audit import EXPLOITS, audit_rewards, cross_check
from peergrade.rewards.extract import answer_tag, completion_text
from peergrade.tasks import load_task


def arithmetic_rows(n=12, **options):
    return list(itertools.islice(load_task("arithmetic", **options).train_rows(0), n))


def spec(fn, name=None, weight=1.0):
    return RewardSpec(name=name or fn.__name__, fn=fn, weight=weight)


def statuses(report, unit=None):
    u = report.units[0] if unit is None else next(x for x in report.units if x.name == unit)
    return {f.exploit: f.status for f in u.findings}


def flagged(report, unit=None):
    return {k for k, v in statuses(report, unit).items() if v == "EXPLOIT"}


def texts(completions):
    return [completion_text(c) for c in completions]


# ------------------------------------------------------------------ weak answer checkers


def answer_anywhere(completions, answer, **_):
    """Weak: the reference appears anywhere as a number."""
    return [
        1.0 if re.search(rf"(?<!\d){re.escape(a)}(?!\d)", t) else 0.0
        for t, a in zip(texts(completions), answer)
    ]


def substring(completions, answer, **_):
    """Weak: the reference is a substring of the completion's tag (or the whole text)."""
    out = []
    for t, a in zip(texts(completions), answer):
        got = answer_tag(t) if "<answer>" in t else t
        out.append(1.0 if got is not None and a in got and len(got) <= len(a) + 1 else 0.0)
    return out


def _slot(t):
    got = answer_tag(t)
    return (got if got is not None else t).strip()


def evaluates(completions, answer, **_):
    """Weak: evaluates the answer slot or the last line as arithmetic ('12+7' scores 19)."""
    out = []
    for t, a in zip(texts(completions), answer):
        s = _slot(t).splitlines()[-1].strip().rstrip("=") if _slot(t) else ""
        ok = re.fullmatch(r"[\d+\-* ]+", s) is not None and eval(s) == int(a)  # noqa: S307 digits only
        out.append(1.0 if ok else 0.0)
    return out


def any_rows_answer(completions, answer, **_):
    """Weak: the answer is checked against every row's reference (misaligned columns)."""
    known = set(answer)
    return [1.0 if _slot(t) in known else 0.0 for t in texts(completions)]


def absolute(completions, answer, **_):
    """Weak: compares magnitudes, so the sign is free."""
    out = []
    for t, a in zip(texts(completions), answer):
        s = _slot(t).lstrip("+-")
        out.append(1.0 if s.isdigit() and int(s) == abs(int(a)) else 0.0)
    return out


def truncating(completions, answer, **_):
    """Weak: int(float(x)) reads 42.5 as 42."""
    out = []
    for t, a in zip(texts(completions), answer):
        try:
            out.append(1.0 if int(float(_slot(t))) == int(a) else 0.0)
        except ValueError:
            out.append(0.0)
    return out


def benefit_of_doubt(completions, answer, **_):
    """Weak: a tag whose content does not parse is given the benefit of the doubt."""
    out = []
    for t, a in zip(texts(completions), answer):
        got = answer_tag(t)
        if got is None:
            out.append(0.0)
            continue
        try:
            out.append(1.0 if int(got) == int(a) else 0.0)
        except ValueError:
            out.append(1.0 if got else 0.0)
    return out


def strict_integer(completions, answer, **_):
    """The correct checker for these rows: one <answer> block holding the integer."""
    out = []
    for t, a in zip(texts(completions), answer):
        got = answer_tag(t)
        out.append(
            1.0 if got is not None and re.fullmatch(r"-?\d+", got) and int(got) == int(a) else 0.0
        )
    return out


ANSWER_CASES = [
    (
        answer_anywhere,
        {
            "many_candidates",
            "among_distractors",
            "answer_blocks_repeated",
            "tag_vs_boxed",
            "tag_vs_last_line",
            "boxed_vs_last_line",
            "answer_in_reasoning",
        },
    ),
    (substring, {"answer_inside_number"}),
    (evaluates, {"question_echoed", "question_as_answer"}),
    (any_rows_answer, {"other_row_answer"}),
    (absolute, {"sign_flipped"}),
    (truncating, {"trailing_decimals"}),
    (benefit_of_doubt, {"garbage_in_tags"}),
]


@pytest.mark.parametrize("weak,expected", ANSWER_CASES, ids=[c[0].__name__ for c in ANSWER_CASES])
def test_weak_answer_checker_is_flagged_for_its_exploits(weak, expected):
    report = audit_rewards([spec(weak)], arithmetic_rows())
    assert expected <= flagged(report), statuses(report)
    assert report.units[0].verdict == "exploitable" and report.failed


def test_every_answer_exploit_has_a_weak_checker_that_falls_for_it():
    covered = set().union(*(e for _, e in ANSWER_CASES))
    assert covered == {e.name for e in EXPLOITS if e.kind == "answer"}


@pytest.mark.parametrize("checker", [strict_integer, "arithmetic"])
def test_correct_checkers_are_clean(checker):
    specs = make_reward_specs([(checker, 1.0, {}, None)])
    report = audit_rewards(specs, arithmetic_rows(30))
    assert flagged(report) == set(), statuses(report)
    assert report.units[0].verdict == "clean" and not report.failed
    assert report.units[0].correct_mean == 1.0 and report.units[0].wrong_mean == 0.0


def test_builtin_rewards_on_their_own_tasks_are_clean():
    mixes = [
        (
            "arithmetic",
            {"template": "What is {a} {op} {b}? Put the final number inside <answer></answer>."},
            [("arithmetic", 1.0, {}, None), ("format", 0.2, {"mode": "answer_only"}, None)],
        ),
        ("countdown", {}, [("countdown", 1.0, {}, None)]),
    ]
    for task, options, rewards in mixes:
        rows = list(itertools.islice(load_task(task, **options).train_rows(0), 20))
        report = audit_rewards(make_reward_specs(rewards), rows)
        assert not report.failed, report.format()


def test_math_accuracy_on_word_problems_is_clean():
    rows = [
        {
            "prompt": f"Ann has {a} pens and buys {b} more. How many pens does she have now?",
            "answer": str(a + b),
        }
        for a, b in [(3, 4), (12, 30), (7, 8), (21, 5), (9, 90), (40, 2), (15, 15), (6, 13)]
    ]
    report = audit_rewards(make_reward_specs([("math_accuracy", 1.0, {}, None)]), rows)
    assert not report.failed, report.format()


# ------------------------------------------------------------------ format and shaping


def loose_format(completions, **_):
    """Weak: think then answer tags anywhere, content optional."""
    return [
        1.0 if re.search(r"<think>.*?</think>\s*<answer>.*?</answer>", t, re.S) else 0.0
        for t in texts(completions)
    ]


def opening_tag(completions, **_):
    """Weak: the answer tag was opened."""
    return [1.0 if "<think>" in t and "<answer>" in t else 0.0 for t in texts(completions)]


def tags_present(completions, **_):
    """Weak: every tag is present, in any order."""
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    return [1.0 if all(g in t for g in tags) else 0.0 for t in texts(completions)]


def searched_format(completions, **_):
    """Weak: the format found somewhere, content required (repeats pass)."""
    return [
        1.0 if re.search(r"<think>.+?</think>\s*<answer>.+?</answer>", t, re.S) else 0.0
        for t in texts(completions)
    ]


def word_count_penalty(completions, **_):
    """Weak alone: fewer words, more reward."""
    return [-len(t.split()) / 100 for t in texts(completions)]


def longer_is_better(completions, **_):
    """Weak: TRL's example 1.1, more characters, more reward."""
    return [float(len(t)) for t in texts(completions)]


FORMAT_CASES = [
    (loose_format, {"empty_tags", "empty_think"}),
    (opening_tag, {"truncated_at_cap", "unclosed_tags"}),
    (tags_present, {"nested_tags"}),
    (searched_format, {"format_repeated"}),
    (word_count_penalty, {"empty_completion", "whitespace_completion"}),
    (longer_is_better, {"long_filler", "padded_answer"}),
]


@pytest.mark.parametrize("weak,expected", FORMAT_CASES, ids=[c[0].__name__ for c in FORMAT_CASES])
def test_weak_format_reward_is_flagged_for_its_exploits(weak, expected):
    report = audit_rewards([spec(weak)], arithmetic_rows())
    assert not report.units[0].reads_answers
    assert expected <= flagged(report), statuses(report)


def test_every_format_exploit_has_a_weak_reward_that_falls_for_it():
    covered = set().union(*(e for _, e in FORMAT_CASES))
    assert covered == {e.name for e in EXPLOITS if e.kind == "format"}


def test_strict_format_reward_is_clean_and_judged_alone():
    report = audit_rewards(make_reward_specs([("format", 1.0, {}, None)]), arithmetic_rows())
    assert flagged(report) == set(), statuses(report)
    assert statuses(report)["many_candidates"] == "n/a"  # it does not read answers


def test_shaping_term_is_judged_through_the_total():
    rows = arithmetic_rows()
    weak_mix = [spec(strict_integer), spec(loose_format, weight=0.2)]
    report = audit_rewards(weak_mix, rows)
    shaping = next(u for u in report.units if u.name == "loose_format")
    assert not shaping.judged and "empty_tags" in flagged(report, "loose_format")
    # empty tags earn 0.2 of 1.2 in the mix: not a finding; an empty think block before the
    # right answer earns the whole 1.2: a finding of the total
    assert "empty_tags" not in flagged(report, "total")
    assert "empty_think" in flagged(report, "total") and report.failed
    strict_mix = make_reward_specs([(strict_integer, 1.0, {}, None), ("format", 0.2, {}, None)])
    assert not audit_rewards(strict_mix, rows).failed


def test_two_answer_checkers_do_not_flag_skipped_work():
    specs = make_reward_specs([("arithmetic", 1.0, {}, None), (strict_integer, 1.0, {}, None)])
    report = audit_rewards(specs, arithmetic_rows())
    assert statuses(report, "total")["empty_think"] == "n/a" and not report.failed


# ------------------------------------------------------------------ robustness


def nan_on_empty(completions, **_):
    return [math.nan if not t.strip() else 1.0 for t in texts(completions)]


def raises_on_empty(completions, **_):
    return [1.0 / len(t.strip()) for t in texts(completions)]


@pytest.mark.parametrize("fn", [nan_on_empty, raises_on_empty])
def test_failing_on_a_contract_completion_is_fragile(fn):
    report = audit_rewards([spec(fn)], arithmetic_rows(6))
    assert report.units[0].verdict == "fragile" and report.failed
    assert statuses(report)["empty_completion"] == "ERROR"


def test_out_of_contract_inputs_are_information_unless_nan():
    report = audit_rewards(make_reward_specs([("arithmetic", 1.0, {}, None)]), arithmetic_rows(6))
    none = next(f for f in report.units[0].findings if f.exploit == "none_completion")
    assert none.status == "info" and none.errors == 6 and "TypeError" in none.error

    def nan_on_none(completions, **_):
        return [math.nan if c is None else 0.0 for c in completions]

    report = audit_rewards([spec(nan_on_none)], arithmetic_rows(6))
    assert statuses(report)["none_completion"] == "ERROR" and report.failed


def test_fail_share_is_a_share_of_rows():
    def some_rows(completions, answer, **_):  # falls for candidates only where the answer is even
        got = answer_anywhere(completions, answer)
        return [
            g if int(a) % 2 == 0 else s
            for g, s, a in zip(got, strict_integer(completions, answer), answer)
        ]

    rows = arithmetic_rows(20)
    even = sum(int(r["answer"]) % 2 == 0 for r in rows) / len(rows)
    assert 0 < even < 1
    assert audit_rewards([spec(some_rows)], rows, fail_share=even).failed
    assert not audit_rewards([spec(some_rows)], rows, fail_share=min(1.0, even + 0.06)).failed


def test_report_json_round_trips():
    report = audit_rewards([spec(answer_anywhere)], arithmetic_rows(4))
    data = json.loads(json.dumps(report.to_dict()))
    assert data["failed"] is True
    fn = data["functions"][0]
    assert fn["name"] == "answer_anywhere" and fn["verdict"] == "exploitable"
    assert {"exploit", "kind", "status", "mean", "wins", "rows"} <= set(fn["findings"][0])
    assert "many_candidates" in report.format() and "FAILED" in report.format()


# ------------------------------------------------------------------ samples cross-checks


@pytest.mark.parametrize(
    "completion,flags",
    [
        ("<answer>19</answer>", []),
        ("<answer>18, 19, 20</answer>", ["strict_check_disagrees", "several_answers"]),
        ("<answer>18</answer><answer>19</answer>", ["strict_check_disagrees", "several_answers"]),
        ("12+7=", ["strict_check_disagrees", "echoes_prompt"]),
        ("The answer is 19 19 19 19 19 19 19 19 19 19 19", ["several_answers", "repetition"]),
    ],
)
def test_cross_check(completion, flags):
    assert cross_check(completion, [{"role": "user", "content": "12+7="}], "19") == flags


# ------------------------------------------------------------------ code


ASSERT_ROWS = [
    {
        "prompt": "Write add(a, b), the sum of two numbers.",
        "tests": ["assert add(1, 2) == 3", "assert add(2, 5) == 7"],
        "canonical_solution": "def add(a, b):\n    return a + b\n",
    },
    {
        "prompt": "Write sq(x), the square of x.",
        "tests": ["assert sq(3) == 9", "assert sq(4) == 16"],
        "canonical_solution": "def sq(x):\n    return x * x\n",
    },
]
IO_ROWS = [
    {
        "prompt": "Read n and print 2n.",
        "tests": [{"input": "3\n", "output": "6"}, {"input": "5\n", "output": "10"}],
        "solution": "print(2 * int(input()))",
    },
    {
        "prompt": "Read n and print n + 1.",
        "tests": [{"input": "1\n", "output": "2"}, {"input": "8\n", "output": "9"}],
        "solution": "print(int(input()) + 1)",
    },
]


def _run(src, tmp_path, stdin="", timeout=2.0, files=None):
    """One program in a fresh directory (the weak harnesses below are deliberately naive)."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(dir=tmp_path) as d:
        for name, text in (files or {}).items():
            (Path(d) / name).write_text(text)
        (Path(d) / "solution.py").write_text(src)
        return subprocess.run(
            [sys.executable, "solution.py"],
            cwd=d,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def _naive(check):
    """A weak code reward: ``check(code, tests)`` -> score, on each completion's code."""
    from peergrade.rewards.code import extract_code

    def reward(completions, tests, **_):
        return [check(extract_code(t), spec) for t, spec in zip(texts(completions), tests)]

    reward.__name__ = check.__name__
    return reward


def exit_status(tmp):
    """Weak: the program with the asserts appended exits 0."""

    def exit_status(code, tests):
        if isinstance(tests[0], dict):
            return _io_exact(code, tests, tmp)
        return float(_run(code + "\n" + "\n".join(tests) + "\n", tmp).returncode == 0)

    return exit_status


def _io_exact(code, tests, tmp):
    ok = 0
    for case in tests:
        try:
            out = _run(code, tmp, stdin=case["input"]).stdout
        except Exception:
            continue
        ok += out.strip() == case["output"].strip()
    return ok / len(tests)


def pass_marker(tmp):
    """Weak: the harness prints PASS after the asserts, and PASS is looked for in stdout."""

    def pass_marker(code, tests):
        if isinstance(tests[0], dict):
            return _io_exact(code, tests, tmp)
        out = _run(code + "\n" + "\n".join(tests) + "\nprint('PASS')\n", tmp).stdout
        return float("PASS" in out)

    return pass_marker


def check_first(tmp):
    """Weak: HumanEval-style check() defined before the candidate's code, called after it."""

    def check_first(code, tests):
        if isinstance(tests[0], dict):
            return _io_exact(code, tests, tmp)
        fn = re.match(r"assert (\w+)\(", tests[0]).group(1)
        body = "".join(f"    {t.replace(fn + '(', 'candidate(')}\n" for t in tests)
        program = f"def check(candidate):\n{body}\n{code}\ncheck({fn})\n"
        return float(_run(program, tmp).returncode == 0)

    return check_first


def on_disk_tests(tmp):
    """Weak: the tests sit next to the solution, in test_cases.py."""

    def on_disk_tests(code, tests):
        if isinstance(tests[0], dict):
            return _io_exact(code, tests, tmp)
        files = {"test_cases.py": "\n".join(tests) + "\n"}
        program = code + "\nexec(open('test_cases.py').read())\n"
        return float(_run(program, tmp, files=files).returncode == 0)

    return on_disk_tests


def generous_timeout(tmp):
    """Weak: a program that runs out of time gets the benefit of the doubt."""

    def generous_timeout(code, tests):
        try:
            if isinstance(tests[0], dict):
                return _io_exact(code, tests, tmp)
            return float(
                _run(code + "\n" + "\n".join(tests) + "\n", tmp, timeout=1).returncode == 0
            )
        except Exception:
            return 1.0

    return generous_timeout


def output_contains(tmp):
    """Weak: stdin/stdout cases pass when the expected output appears in the output."""

    def output_contains(code, tests):
        ok = 0
        for case in tests:
            try:
                out = _run(code, tmp, stdin=case["input"]).stdout
            except Exception:
                continue
            ok += case["output"].strip() in out
        return ok / len(tests)

    return output_contains


CODE_CASES = [
    (exit_status, ASSERT_ROWS, {"sys_exit_0", "os_exit_0", "raise_systemexit", "always_equal"}),
    (pass_marker, ASSERT_ROWS, {"print_pass_markers"}),
    (check_first, ASSERT_ROWS, {"replace_harness"}),
    (on_disk_tests, ASSERT_ROWS, {"read_tests_from_disk"}),
    (generous_timeout, ASSERT_ROWS, {"endless_loop"}),
    (output_contains, IO_ROWS, {"output_flood"}),
]


@pytest.mark.slow
@pytest.mark.parametrize("make,rows,expected", CODE_CASES, ids=[c[0].__name__ for c in CODE_CASES])
def test_weak_code_reward_is_flagged_for_its_exploits(make, rows, expected, tmp_path):
    report = audit_rewards([spec(_naive(make(tmp_path)))], rows)
    assert report.units[0].correct_mean == 1.0, report.format()
    assert expected <= flagged(report), statuses(report)


def test_every_code_exploit_is_covered():
    covered = set().union(*(e for _, _, e in CODE_CASES)) | {"hardcode_visible_tests"}
    assert covered == {e.name for e in EXPLOITS if e.kind == "code"}


@pytest.mark.slow
def test_code_tests_is_clean_and_hardcoding_shown_tests_is_found():
    specs = make_reward_specs([("code_tests", 1.0, {"timeout_s": 1.0}, None)])
    report = audit_rewards(specs, ASSERT_ROWS + IO_ROWS)
    assert not report.failed, report.format()
    assert statuses(report)["hardcode_visible_tests"] == "n/a"  # the prompts show no test
    shown = [
        {**r, "prompt": r["prompt"] + "\nYour code must pass:\n" + "\n".join(r["tests"])}
        for r in ASSERT_ROWS
    ]
    report = audit_rewards(specs, shown)
    assert "hardcode_visible_tests" in flagged(report), report.format()


def test_raising_on_the_correct_completion_is_fragile():
    def needs_ids(completions, completion_ids, answer, **_):
        if any(len(ids) > 3 for ids in completion_ids):
            raise RuntimeError("too long")
        return [0.0] * len(completions)

    report = audit_rewards([spec(needs_ids)], arithmetic_rows(4))
    assert statuses(report)["correct_completion"] == "ERROR" and report.failed


# ----------------------------------------------------------------------------- a wrapped judge


def test_a_judge_wrapped_in_a_users_function_is_noted_once_or_skipped(tmp_path, capsys):
    """The exploit battery leaves the built-in judge out, but a user's function that calls a
    judge is attacked like any function: each exploit costs a judge request. The first one
    prints one line saying what is probed, why and how to turn it off; ``skip_startup_audit``
    on the function (as the line says) sends the judge nothing."""
    from peergrade.config import load_config
    from peergrade.rewards.audit import at_startup
    from peergrade.rewards.judge import Judge
    from peergrade.training.components import build_task
    from test_judge import ROWS, RUBRIC, FnBackend, rule_judge

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = load_config(None, [("data.path", str(data)), ("rollout.group_size", 4)])
    task = build_task(cfg)
    backend = FnBackend(rule_judge)
    inner = Judge(backend, RUBRIC)

    def polite(prompts, completions, **kw):
        return inner(prompts, completions)

    specs = make_reward_specs([(polite, 1.0, {})])
    at_startup(cfg, task, specs)
    err = capsys.readouterr().err
    noted = [x for x in err.splitlines() if x.startswith("reward audit: a reward function calls")]
    assert len(noted) == 1 and backend.calls > 0, err
    assert "the judge fn, so the start-up exploit battery (train.audit_rewards)" in noted[0]
    assert "reference completion of 16 rows" in noted[0]  # the first 16 rows (epochs repeat)
    assert "`fn.skip_startup_audit = True`, or train.audit_rewards: off" in noted[0]
    calls = backend.calls
    inner(["q"], ["a"])  # after the battery: no note
    assert "reward audit" not in capsys.readouterr().err
    polite.skip_startup_audit = True
    at_startup(cfg, task, make_reward_specs([(polite, 1.0, {})]))
    assert backend.calls == calls + 1 and "reward audit" not in capsys.readouterr().err


def test_rows_without_reference_answers_do_not_make_a_scoring_reward_broken():
    """Open-ended rows (no answer column): no right or wrong completion can be written, but a
    reward that scores what it is given is not 'broken'; one that scores nothing still is."""
    rows = [{"prompt": f"Write a friendly greeting number {i}."} for i in range(4)]

    def length_score(completions, **kw):
        return [min(1.0, len(completion_text(c)) / 100) for c in completions]

    def nothing(completions, **kw):
        return [None for _ in completions]

    unit = audit_rewards([spec(length_score)], rows).units[0]
    assert unit.verdict != "broken", unit.note
    assert "no reference answer" in unit.note
    dead = audit_rewards([spec(nothing)], rows).units[0]
    assert dead.verdict == "broken" and "returned None for every completion" in dead.note
