"""Table-driven tests for the ``code_tests`` reward and its helpers."""

from __future__ import annotations

import json

import pytest

import peergrade.rewards.code as code_mod
from peergrade.rewards.code import code_tests, extract_code, normalise_output, parse_tests

FAST = {"timeout_s": 3.0, "memory_mb": 256, "workers": 2}

DOUBLE_IO = [{"input": "2\n", "output": "4\n"}, {"input": "5", "output": "10"}]
DOUBLE_ASSERTS = "assert f(2) == 4\nassert f(5) == 10\nassert f(0) == 0\nassert f(-1) == -2"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("print(1)", "print(1)"),  # no fence: the whole text
        ("Here:\n```python\nprint(1)\n```\ndone", "print(1)\n"),
        ("```python\na = 1\n```\nthen\n```python\nb = 2\n```", "b = 2\n"),  # the last one
        ("```\nx = 1\n```", "x = 1\n"),  # untagged
        ("```py\nx = 1\n```\n```\ny = 2\n```", "x = 1\n"),  # tagged python wins over untagged
        ("```bash\nrm -rf /\n```\n```\ny = 2\n```", "y = 2\n"),  # other languages never
        ("```bash\nls\n```", "```bash\nls\n```"),  # only another language: the whole text
        ("```python3\nz = 3\n", "z = 3\n"),  # unclosed (truncated) fence runs to the end
        ("```Python\nq = 1\n```", "q = 1\n"),
    ],
)
def test_extract_code(text, expected):
    assert extract_code(text) == expected


@pytest.mark.parametrize(
    "a, b, equal",
    [
        ("4\n", "4", True),
        ("1 2  \r\n3\t\n\n", "1 2\n3", True),
        ("\n\n4", "4", True),
        ("1 2", "1  2", False),  # inner whitespace matters
        ("4\n5", "4 5", False),
        ("  4", "4", False),  # leading spaces on a line matter
    ],
)
def test_normalise_output(a, b, equal):
    assert (normalise_output(a) == normalise_output(b)) is equal


def test_parse_tests_forms():
    io = parse_tests(DOUBLE_IO)
    assert io.kind == "io" and io.cases == [("2\n", "4\n"), ("5", "10")]
    assert parse_tests(json.dumps(DOUBLE_IO)).cases == io.cases
    apps = parse_tests({"inputs": ["1", "2"], "outputs": ["2", "4"]})
    assert apps.kind == "io" and apps.cases == [("1", "2"), ("2", "4")]
    asserts = parse_tests(DOUBLE_ASSERTS)
    assert asserts.kind == "assert" and asserts.total == 4
    assert asserts.asserts[1] == "assert f(5) == 10"
    multi = parse_tests("for x in range(3):\n    assert f(x) == 2 * x\nassert f(9) == 18")
    assert multi.asserts == ["for x in range(3):\n    assert f(x) == 2 * x", "assert f(9) == 18"]
    assert parse_tests(["assert f(1) == 2", "assert f(2) == 4"]).total == 2
    assert parse_tests(json.dumps(["assert f(1) == 2"])).kind == "assert"
    assert parse_tests(None) is None


@pytest.mark.parametrize(
    "spec, message",
    [
        ([], "empty test list"),
        ("[{bad json", "does not parse"),
        ({"inputs": ["1"]}, "must have 'inputs' and 'outputs'"),
        ({"inputs": ["1"], "outputs": []}, "equal length"),
        ([{"input": "1"}], r"tests\[3\]\[0\]: expected a dict with 'input' and 'output'"),
        ([{"input": 1, "output": "1"}], "must be strings"),
        ("assert f(1) ==", "not valid Python"),
        (42, "got int"),
        (["assert f(1) == 2", {"input": "1", "output": "2"}], "expected a dict"),
    ],
)
def test_malformed_tests_spec_is_a_clear_error(spec, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_tests(spec, index=3)
    assert "tests[3]" in str(info.value)


def test_stdin_stdout_cases_fraction_and_all():
    completions = [
        "```python\nprint(int(input()) * 2)\n```",  # passes both
        "```python\nn = int(input())\nprint(4 if n == 2 else 0)\n```",  # passes one
        "```python\nprint(int(input()) +)\n```",  # syntax error
        "no code here at all",
    ]
    tests = [DOUBLE_IO] * 4
    assert code_tests(None, completions, tests, **FAST) == [1.0, 0.5, 0.0, 0.0]
    report = code_mod.last_report
    assert [r["passed"] for r in report] == [2, 1, 0, 0]
    assert report[1]["reasons"] == ["case 1: wrong output"]
    assert "SyntaxError" in report[2]["reasons"][0] and report[2]["statuses"] == {"error": 2}
    assert code_tests(None, completions, tests, mode="all", **FAST) == [1.0, 0.0, 0.0, 0.0]


def test_assert_tests_fraction_and_all():
    completions = [
        "```python\ndef f(x):\n    return 2 * x\n```",
        "```python\ndef f(x):\n    return abs(2 * x)\n```",  # fails f(-1) only
        "```python\ndef f(x):\n    raise RuntimeError('nope')\n```",
        "```python\nimport os\ndef f(x):\n    return x\nos._exit(0)\n```",  # exits before tests
        "```python\nraise SystemExit(0)\n```",
    ]
    tests = [DOUBLE_ASSERTS] * 5
    assert code_tests(None, completions, tests, **FAST) == [1.0, 0.75, 0.0, 0.0, 0.0]
    r = code_mod.last_report
    assert r[1]["reasons"] == ["test 3: AssertionError: "]
    assert all("RuntimeError: nope" in x for x in r[2]["reasons"])
    assert "exited early" in r[3]["reasons"][0]
    assert code_tests(None, completions, tests, mode="all", **FAST) == [1.0, 0, 0, 0, 0]


def test_main_block_does_not_run_in_assert_mode():
    completion = (
        "def f(x):\n    return 2 * x\n\nif __name__ == '__main__':\n    print(f(int(input())))\n"
    )
    assert code_tests(None, [completion], [DOUBLE_ASSERTS], **FAST) == [1.0]


@pytest.mark.parametrize(
    "completion",
    [
        # prints forged pass reports (it cannot know the nonce)
        "def f(x):\n    return -7\nfor i in range(4):\n    print(f'xx {i} pass')\n",
        # tries to read the nonce, which is gone before the candidate runs
        "def f(x):\n    return -7\nimport os\nprint(os.listdir('.'))\n",
        # the always-equal object, bare and inside a list
        "class A:\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return A()\n",
        "class A(int):\n    def __eq__(self, o):\n        return True\n"
        "def f(x):\n    return A(0)\n",
    ],
)
def test_assert_reward_hacks_score_zero(completion):
    assert code_tests(None, [completion], [DOUBLE_ASSERTS], **FAST) == [0.0]


def test_always_equal_inside_a_container_fails():
    completion = (
        "class A:\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return [A()]\n"
    )
    assert code_tests(None, [completion], ["assert f(1) == [2]"], **FAST) == [0.0]
    assert "defines its own __eq__" in code_mod.last_report[0]["reasons"][0]


def test_none_tests_are_not_applicable_and_chat_completions_work():
    completions = [
        [{"role": "assistant", "content": "```python\nprint(int(input()) * 2)\n```"}],
        "print(1)",
    ]
    out = code_tests(None, completions, [json.dumps(DOUBLE_IO), None], **FAST)
    assert out == [1.0, None]


def test_hostile_programs_score_zero_with_reasons():
    hostile = [
        "while True:\n    pass",
        "import time\ntime.sleep(30)",
        "x = bytearray(10 ** 10)",
        "while True:\n    print('x' * 1000)",
        "import os\nwhile True:\n    os.fork()",
    ]
    out = code_tests(
        None, hostile, [DOUBLE_IO] * len(hostile), timeout_s=1.5, memory_mb=256, workers=2
    )
    assert out == [0.0] * len(hostile)
    for r in code_mod.last_report:
        assert r["reasons"] and "ok" not in r["statuses"]


def test_tampering_with_the_sandbox_voids_the_tests_passed_before(capsys):
    """Unsandboxed (the only setup where the launcher is within reach), a candidate that passes
    three tests and then kills its launcher scores 0, with the reason, not 0.75 or an error."""
    completion = (
        "import os\ncalls = []\ndef f(x):\n    calls.append(x)\n"
        "    if len(calls) == 4:\n        os.kill(os.getppid(), 9)\n    return 2 * x\n"
    )
    out = code_tests(None, [completion], [DOUBLE_ASSERTS], sandbox="none", **FAST)
    assert out == [0.0]
    report = code_mod.last_report[0]
    assert report["statuses"] == {"tampered": 1}
    assert any("tampered with its sandbox" in r for r in report["reasons"])
    assert "UNSANDBOXED" in capsys.readouterr().err


def test_identical_completions_run_once(monkeypatch):
    calls = []
    real = code_mod.run_many

    def counting(jobs, **kw):
        calls.append(len(jobs))
        return real(jobs, **kw)

    monkeypatch.setattr(code_mod, "run_many", counting)
    same = "```python\nprint(int(input()) * 2)\n```"
    assert code_tests(None, [same] * 4, [DOUBLE_IO] * 4, **FAST) == [1.0] * 4
    assert calls == [2]  # 2 cases, once each


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tests": None}, "needs test columns: 'tests'"),
        ({"tests": [DOUBLE_IO]}, "one entry per completion"),
        ({"tests": DOUBLE_ASSERTS}, "single value"),
        ({"tests": [DOUBLE_IO] * 2, "test_format": "leetcode"}, "test_format must be one of"),
        ({"tests": [DOUBLE_IO] * 2, "sandbox": "off"}, "sandbox must be one of"),
        ({"tests": [DOUBLE_IO, DOUBLE_IO], "mode": "most"}, "mode must be 'fraction' or 'all'"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        code_tests(None, ["print(1)", "print(2)"], **kwargs)


def test_registered_by_name():
    from peergrade.rewards import resolve_reward

    assert resolve_reward("code_tests") is code_tests


# --- code datasets as they come -------------------------------------------------------------
# A few rows shaped like each public dataset (same columns, same conventions), written here.

HUMANEVAL = [
    {
        "task_id": "HumanEval/0",
        "prompt": 'def add(a: int, b: int) -> int:\n    """Sum of a and b."""\n',
        "entry_point": "add",
        "canonical_solution": "    return a + b\n",
        "test": "\n\nMETADATA = {'author': 'x', 'dataset': 'test'}\n\n\ndef check(candidate):\n"
        "    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n"
        "    assert candidate(10, 5) == 15\n",
    },
    {
        "task_id": "HumanEval/1",
        "prompt": "from typing import List\n\n\ndef evens(xs: List[int]) -> List[int]:\n"
        '    """The even numbers of xs, in order."""\n',
        "entry_point": "evens",
        "canonical_solution": "    return [x for x in xs if x % 2 == 0]\n",
        "test": "\n\nMETADATA = {}\n\n\ndef check(candidate):\n"
        "    assert candidate([1, 2, 3, 4]) == [2, 4]\n    assert candidate([]) == []\n"
        "    assert candidate([7]) == []\n",
    },
    {
        "task_id": "HumanEval/2",
        "prompt": 'def mean(xs: list) -> float:\n    """Arithmetic mean."""\n',
        "entry_point": "mean",
        "canonical_solution": "    return sum(xs) / len(xs)\n",
        "test": "\n\nMETADATA = {}\n\n\ndef check(candidate):\n"
        "    assert abs(candidate([1.0, 2.0, 3.0]) - 2.0) < 1e-6\n"
        "    assert abs(candidate([5.0]) - 5.0) < 1e-6\n",
    },
]


def _chat(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}```\n"


def _humaneval_columns(rows, field="test"):
    return {field: [r["test"] for r in rows], "entry_point": [r["entry_point"] for r in rows]}


def test_humaneval_rows_reference_solutions_score_1_and_return_none_scores_0():
    rows = HUMANEVAL
    prompts = [r["prompt"] for r in rows]
    good = [_chat(r["prompt"] + r["canonical_solution"]) for r in rows]
    none = [_chat(r["prompt"] + "    return None\n") for r in rows]
    body_only = [r["canonical_solution"] for r in rows]  # base-model style: continues the prompt
    cols = _humaneval_columns(rows)
    assert code_tests(prompts, good, **cols, **FAST) == [1.0, 1.0, 1.0]
    assert [r["total"] for r in code_mod.last_report] == [1, 1, 1]  # one program = one test
    assert code_tests(prompts, none, **cols, **FAST) == [0.0, 0.0, 0.0]
    assert all("check(" not in x or "fail" in x for r in code_mod.last_report for x in r["reasons"])
    assert code_tests(prompts, body_only, **cols, **FAST) == [1.0, 1.0, 1.0]


def test_humaneval_test_string_in_the_tests_column_is_one_test_not_one_per_statement():
    """The reward-hacking trap of issue 13: METADATA = ... and def check(...) used to count as
    passed tests under fraction mode, so `return None` earned 0.5 or more."""
    rows = HUMANEVAL
    none = [_chat(r["prompt"] + "    return None\n") for r in rows]
    good = [_chat(r["prompt"] + r["canonical_solution"]) for r in rows]
    cols = _humaneval_columns(rows, field="tests")
    for mode in ("fraction", "all"):
        assert code_tests(None, none, **cols, mode=mode, **FAST) == [0.0] * 3
        assert code_tests(None, good, **cols, mode=mode, **FAST) == [1.0] * 3
    spec = parse_tests(rows[0]["test"], entry_point="add")
    assert spec.total == 1 and spec.asserts == ["check(add)"]
    with pytest.raises(ValueError, match="entry_point"):
        parse_tests(rows[0]["test"], index=0)  # check() is never called and nothing says on what


def test_plain_statements_never_count_as_tests():
    spec = parse_tests(
        "import math\nMETADATA = {'a': 1}\ndef helper(x):\n    return x\n"
        "assert f(1) == 2\nfor x in range(3):\n    assert f(x) == 2 * x\nprint('done')\n"
    )
    assert spec.total == 2
    assert [k for k, _ in spec.steps] == ["setup", "setup", "setup", "test", "test", "setup"]
    # a helper the tests define and then call is a test; a bare print is not
    calls = parse_tests("def check(f):\n    assert f(2) == 4\ncheck(f)\nprint(1)\n")
    assert calls.asserts == ["check(f)"]
    with pytest.raises(ValueError, match="no test in the string"):
        parse_tests("METADATA = {}\nx = 1\n", index=2)
    # fraction over the real tests only: 1 of 2 passes -> 0.5, setup statements ignored
    tests = "import math\nMETADATA = {}\nassert f(2) == 4\nassert f(3) == 9\n"
    out = code_tests(None, ["def f(x):\n    return 2 * x\n"], [tests], **FAST)
    assert out == [0.5]


def test_candidate_shadowing_a_builtin_does_not_fool_the_tests():
    hack = "def mean(xs):\n    return None\ndef abs(x):\n    return 0\n"
    cols = _humaneval_columns(HUMANEVAL[2:])
    assert code_tests(None, [hack], **cols, **FAST) == [0.0]


MBPP = [
    {
        "task_id": 11,
        "text": "Write a function to remove the first and last occurrence of a character.",
        "code": "def remove_Occ(s, ch):\n    s = s.replace(ch, '', 1)\n    i = s.rfind(ch)\n"
        "    return s if i < 0 else s[:i] + s[i + 1:]\n",
        "test_list": [
            'assert remove_Occ("hello","l") == "heo"',
            'assert remove_Occ("abcda","a") == "bcd"',
            'assert remove_Occ("PHP","P") == "H"',
        ],
        "test_setup_code": "",
        "challenge_test_list": [],
    },
    {
        "task_id": 12,
        "text": "Write a function to find the square root of the sum of two squares.",
        "code": "def hyp(a, b):\n    return math.sqrt(a * a + b * b)\n",
        "test_list": ["assert hyp(3, 4) == 5.0", "assert hyp(5, 12) == 13.0"],
        "test_setup_code": "",
        "test_imports": ["import math"],
        "challenge_test_list": [],
    },
]


def test_mbpp_rows():
    rows = MBPP
    cols = {
        "test_list": [r["test_list"] for r in rows],
        "test_setup_code": [r["test_setup_code"] for r in rows],
        "test_imports": [r.get("test_imports", []) for r in rows],
    }
    good = [_chat(("import math\n" if "math" in r["code"] else "") + r["code"]) for r in rows]
    none = [_chat(r["code"].split("\n")[0] + "\n    return None\n") for r in rows]
    assert code_tests(None, good, **cols, **FAST) == [1.0, 1.0]
    assert code_tests(None, none, **cols, **FAST) == [0.0, 0.0]
    # fraction counts each assert: right on 2 of 3 -> 2/3
    partial = "def remove_Occ(s, ch):\n    return s if s == 'PHP' else s.replace(ch, '')\n"
    assert code_tests(None, [partial], **{k: v[:1] for k, v in cols.items()}, **FAST) == [2 / 3]
    assert code_mod.last_report[0]["total"] == 3


APPS = [
    {  # standard input / output
        "problem_id": 1,
        "question": "Read n and print n squared.",
        "input_output": json.dumps({"inputs": ["3\n", "10\n"], "outputs": ["9\n", "100\n"]}),
        "solution": "n = int(input())\nprint(n * n)\n",
        "wrong": "n = int(input())\nprint(n + n)\n",
    },
    {  # call-based: fn_name, arguments as a list, the expected value wrapped in a list
        "problem_id": 2,
        "question": "Return the largest of the numbers.",
        "input_output": json.dumps(
            {"fn_name": "biggest", "inputs": [[[1, 5, 2]], [[-3, -1]]], "outputs": [[5], [-1]]}
        ),
        "solution": "def biggest(xs):\n    return max(xs)\n",
        "wrong": "def biggest(xs):\n    return None\n",
    },
    {  # LeetCode style (TACO): a Solution class
        "problem_id": 3,
        "question": "Return the length of the list.",
        "input_output": json.dumps(
            {"fn_name": "size", "inputs": [[[1, 2]], [[]]], "outputs": [2, 0]}
        ),
        "solution": "class Solution:\n    def size(self, xs):\n        return len(xs)\n",
        "wrong": "class Solution:\n    def size(self, xs):\n        return None\n",
    },
]


def test_apps_rows():
    cols = {"input_output": [r["input_output"] for r in APPS]}
    assert code_tests(None, [_chat(r["solution"]) for r in APPS], **cols, **FAST) == [1.0] * 3
    assert [r["total"] for r in code_mod.last_report] == [2, 2, 2]
    assert code_tests(None, [_chat(r["wrong"]) for r in APPS], **cols, **FAST) == [0.0] * 3


def test_codecontests_rows():
    row = {
        "name": "1_A. Sum",
        "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
        "private_tests": {"input": ["5 5\n", "0 0\n"], "output": ["10\n", "0\n"]},
        "generated_tests": {"input": [], "output": []},
    }
    empty_private = {**row, "private_tests": {"input": [], "output": []}}
    cols = {k: [row[k], empty_private[k]] for k in ("public_tests", "private_tests")}
    good = "a, b = map(int, input().split())\nprint(a + b)\n"
    assert code_tests(None, [good, good], **cols, **FAST) == [1.0, 1.0]
    assert [r["total"] for r in code_mod.last_report] == [3, 1]
    wrong = "a, b = map(int, input().split())\nprint(a * b)\n"  # right on 0 0 only
    assert code_tests(None, [wrong, wrong], **cols, **FAST) == [1 / 3, 0.0]


def test_test_format_selects_the_columns():
    """With several test columns, test_format says which one is meant."""
    he = HUMANEVAL[0]
    cols = {
        "test": [he["test"]],
        "entry_point": [he["entry_point"]],
        "test_list": [["assert add(1, 1) == 3"]],  # a contradictory MBPP column
    }
    good = _chat(he["prompt"] + he["canonical_solution"])
    assert code_tests(None, [good], **cols, **FAST) == [1.0]  # auto: HumanEval before MBPP
    assert code_tests(None, [good], **cols, test_format="mbpp", **FAST) == [0.0]
    with pytest.raises(ValueError, match="input_output"):
        code_tests(None, [good], **cols, test_format="apps", **FAST)


# --- fail closed ------------------------------------------------------------------------------


def test_a_sandbox_error_is_raised_with_the_other_scores_and_counted(monkeypatch):
    """A program the sandbox could not run is never scored 0 silently: code_tests raises a
    SandboxError carrying the other samples' scores; score_rewards counts it under
    reward/code_tests/sandbox_errors (on_reward_error=zero) or stops the run (fail)."""
    from peergrade.rewards import RewardError, make_reward_spec, score_rewards
    from peergrade.rewards.sandbox import SandboxResult

    real = code_mod.run_many

    def one_breaks(jobs, **kw):  # fault injection: the sandbox fails for the 2nd program only
        out = real(jobs, **kw)
        out[1] = SandboxResult("sandbox_error", None, "", "", "mount: injected", 0.0)
        return out

    monkeypatch.setattr(code_mod, "run_many", one_breaks)
    completions = ["print(int(input()) * 2)", "print(int(input()) * 2 + 0)"]
    tests = [[{"input": "2", "output": "4"}]] * 2
    with pytest.raises(code_mod.SandboxError) as info:
        code_tests(None, completions, tests, **FAST)
    assert info.value.scores == [1.0, None] and list(info.value.failed) == [1]
    assert "mount: injected" in str(info.value)

    spec = make_reward_spec("code_tests", kwargs=FAST)
    scores = score_rewards([spec], [None, None], completions, {"tests": tests}, on_error="zero")
    m = scores.metrics()
    assert m["reward/code_tests/sandbox_errors"] == 1.0 and m["reward/errors"] == 1.0
    assert scores.per_fn["code_tests"].tolist() == [1.0, 0.0]
    assert "sample 1: sandbox error" in scores.errors[0]
    with pytest.raises(RewardError, match="sandbox error"):
        score_rewards([spec], [None, None], completions, {"tests": tests}, on_error="fail")
    monkeypatch.setattr(code_mod, "run_many", real)
    ok = score_rewards([spec], [None, None], completions, {"tests": tests}, on_error="zero")
    assert ok.metrics()["reward/code_tests/sandbox_errors"] == 0.0  # always reported


def test_building_the_reward_runs_the_self_test_and_fails_closed(monkeypatch, capsys):
    from peergrade.rewards import make_reward_spec
    from peergrade.rewards import sandbox as sb

    calls = []
    real = sb.self_test
    monkeypatch.setattr(sb, "_required", {})
    monkeypatch.setattr(sb, "self_test", lambda *a, **k: calls.append(k) or real(*a, **k))
    make_reward_spec("code_tests")
    assert calls == [{"mechanism": "auto", "network": False}]
    # a sandbox that lets the canary out stops the run before the first step
    monkeypatch.setattr(sb, "_required", {})
    monkeypatch.setattr(
        sb, "self_test", lambda *a, **k: {**real(*a, **k), "escapes": ["write outside (/x)"]}
    )
    with pytest.raises(sb.SandboxUnavailable, match=r"could: write outside \(/x\).*sandbox: none"):
        make_reward_spec("code_tests")
    # ... and a reward built without the preflight refuses on its first call, whatever the
    # on_reward_error policy (never a batch of silent zeros)
    from peergrade.rewards import RewardSpec, score_rewards

    bare = RewardSpec(name="code_tests", fn=code_tests, kwargs=FAST)
    with pytest.raises(sb.SandboxUnavailable):
        score_rewards([bare], [None], ["print(4)"], {"tests": [DOUBLE_IO]}, on_error="zero")
    # the explicit opt-out runs no self-test and warns, at build time and on every call
    make_reward_spec("code_tests", kwargs={"sandbox": "none"})
    out = code_tests(None, ["print(4)"], [[{"input": "", "output": "4"}]], sandbox="none", **FAST)
    assert out == [1.0]
    assert capsys.readouterr().err.count("UNSANDBOXED") == 2


# --- end to end: peergrade train on a HumanEval-shaped JSONL -----------------------------------


def _train(tmp_path, model_dir, prefix=(), run="run"):
    import os
    import subprocess
    import sys

    data = tmp_path / "he.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in HUMANEVAL))
    args = ["train", "--data", str(data), "--reward", "code_tests", "--model", str(model_dir)]
    args += ["--steps", "1", "--rollout.prompts_per_step", "2", "--rollout.group_size", "2"]
    args += ["--rollout.max_completion_length", "8", "--train.display", "none"]
    args += ["--train.threads", "1", "-o", str(tmp_path / run)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*prefix, sys.executable, "-m", "peergrade.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )


@pytest.mark.slow
def test_train_on_humaneval_rows_reports_sandbox_errors_every_step(tiny_model_dir, tmp_path):
    proc = _train(tmp_path, tiny_model_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    step = [r for r in rows if "loss/policy" in r][0]
    assert step["reward/code_tests/sandbox_errors"] == 0.0 and step["reward/errors"] == 0.0
    assert step["reward/code_tests/mean"] == 0.0  # the tiny model's gibberish passes nothing


@pytest.mark.slow
def test_train_without_a_usable_sandbox_stops_with_one_error_line(tiny_model_dir, tmp_path):
    """Root with every capability dropped can isolate nothing: one error before the model
    loads, no traceback, nothing run."""
    import os
    import shutil

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop every capability")
    proc = _train(tmp_path, tiny_model_dir, ["setpriv", "--bounding-set=-all", "--inh-caps=-all"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: the code sandbox"), lines
    assert "sandbox: none" in lines[0] and "CAP_SETUID" in lines[0]
    assert "Traceback" not in proc.stderr
