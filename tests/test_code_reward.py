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
        ({"tests": None}, "needs a 'tests' column"),
        ({"tests": [DOUBLE_IO]}, "one entry per completion"),
        ({"tests": DOUBLE_ASSERTS}, "single spec"),
        ({"tests": [DOUBLE_IO, DOUBLE_IO], "mode": "most"}, "mode must be 'fraction' or 'all'"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        code_tests(None, ["print(1)", "print(2)"], **kwargs)


def test_registered_by_name():
    from peergrade.rewards import resolve_reward

    assert resolve_reward("code_tests") is code_tests
