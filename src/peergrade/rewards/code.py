"""``code_tests``: reward a completion by running its code against the sample's tests.

TRL-style signature: ``code_tests(prompts, completions, tests, **columns) -> list[float | None]``.
Every program runs in ``peergrade.rewards.sandbox`` (separate process, limits, no network, ...).
Before the first use (``preflight``, run when the reward is built, and again on the first call)
the sandbox must pass its self-test, or ``SandboxUnavailable`` stops the run with what is
missing and how to fix it; ``sandbox="none"`` runs unsandboxed, with a warning every time.

Code extraction (``extract_code``): the last fenced block tagged ``python``/``py``/``python3``;
else the last fenced block with no language tag; else the whole completion text. A fence left
open at the very end (a truncated generation) counts as a block running to the end of the text.
Blocks tagged with another language (```bash, ```text) are never taken.

Where the tests come from (``test_format``; ``"auto"``, the default, takes the first present):

- ``"tests"``: a ``tests`` column, one spec per sample (the forms below);
- ``"apps"``: APPS / TACO's ``input_output`` (a JSON string ``{"inputs", "outputs"}``; with
  ``fn_name`` the rows are call-based: each (arguments, expected value) pair is one test, the
  function taken from the module or from a ``Solution`` class, the expected value compared
  as is or unwrapped from its one-element list);
- ``"codecontests"``: CodeContests' ``public_tests`` and ``private_tests`` (each
  ``{"input": [...], "output": [...]}``), merged; ``generated_tests`` are not used;
- ``"humaneval"``: HumanEval's ``test`` program (defines ``check(candidate)``) and
  ``entry_point``: the whole program then ``check(<entry_point>)`` is ONE test;
- ``"mbpp"``: MBPP's ``test_list`` (each assert one test), run after ``test_imports`` and
  ``test_setup_code``; ``challenge_test_list`` is not used.

With an ``entry_point`` column and a prompt that defines that function, a completion that only
continues the prompt (a function body, as base models write it) runs after the prompt's code.

Test specifications (one entry per sample; a JSON string of any of these is accepted too):

- stdin/stdout cases: ``[{"input": "...", "output": "..."}, ...]`` or the APPS/TACO layout
  ``{"inputs": [...], "outputs": [...]}``. One process per case, with the case's input on stdin.
  A case passes when the program exits 0 and its output equals the expected output after
  normalisation: ``\\r\\n`` -> ``\\n``, trailing whitespace removed from every line, and leading and
  trailing blank lines removed (``normalise_output``).
- assert statements: a string or a list of strings. Only real tests count: a top-level
  statement (or list entry) is a test when it contains an ``assert`` or calls a check function
  the tests themselves define (``check(f)``); everything else (imports, ``METADATA = ...``,
  ``def check``) is setup, run in order and never counted, so ``fraction`` cannot be earned by
  plain statements. A string that defines ``check`` and calls nothing is a HumanEval program:
  with an ``entry_point`` column it is ONE test (above), without one it is an error. One
  process per sample: a harness runs the candidate's code as module ``solution`` (so an
  ``if __name__ == "__main__":`` block does NOT run), then the steps in a namespace holding the
  candidate's names except its shadows of builtins, reporting each test on stdout tagged with
  a random nonce the program cannot see in its source or stdin (the harness reads it, and the
  tests, from files that it deletes before the candidate runs: neither is on disk or in
  ``main.py`` for the candidate to read). A test passes when it ran without raising (SystemExit
  included). A program that exits early, or crashes, passes none of the remaining tests. Tests
  reported before a timeout still count.
- ``None``: the sample has no tests; its reward is ``None`` (not applicable).

Reward per sample: ``mode="fraction"``: passed / total; ``mode="all"``: 1.0 if every test
passed else 0.0. Identical (code, tests) pairs in a batch (common within a GRPO group) are run
once.

Diagnostics: after each call the module-level ``last_report`` holds one dict per sample
(``index``, ``reward``, ``passed``, ``total``, ``statuses`` (sandbox status per process),
``reasons`` (why tests failed)). It is overwritten by the next call (not thread-safe across
concurrent calls). A malformed test specification is a dataset error: it raises ValueError
naming the sample index and what was expected. Anything the program does scores 0 for that
test, never raises; a program that tampers with its sandbox (``tampered``: it killed its
launcher or forged its report) scores 0 for the whole sample, whatever it passed before.
A program the sandbox itself could not run (``sandbox_error``) is not the
program's fault and is never scored 0 silently: ``code_tests`` raises ``SandboxError`` (a
``RewardSampleErrors``) carrying the other samples' scores, and ``score_rewards`` puts those
samples through ``on_reward_error`` and counts them in ``reward/code_tests/sandbox_errors``.

Reward-hacking guard for assert tests: every operand of a comparison in a test is checked
before comparing; a value whose class was defined by the candidate with its own ``__eq__`` or
``__ne__`` (also inside lists, tuples, sets and dicts, 3 levels deep) fails the test, which
defeats the "always equal" object. Limits (documented, not defended): the candidate runs in the
same interpreter as the harness, so a deliberately adversarial program can still defeat assert
tests (e.g. patch the harness from inside a called function, or dig the nonce out of the
harness's frames).
stdin/stdout cases are compared outside the sandbox and have no such hole; prefer them for
RL on untrusted models.

What this module does not do: generate tests, grade style, or run languages other than Python.
"""

from __future__ import annotations

import ast
import json
import os
import re
import secrets
from collections import Counter
from dataclasses import dataclass, field

from .extract import completion_text
from .registry import RewardSampleErrors
from .sandbox import MECHANISMS, SandboxLimits, SandboxResult, require_sandbox, run_many

__all__ = [
    "TEST_FORMATS",
    "SandboxError",
    "code_tests",
    "extract_code",
    "last_report",
    "normalise_output",
    "parse_tests",
]

last_report: list[dict] = []
"""Per-sample diagnostics of the most recent ``code_tests`` call (see the module docstring)."""

_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:^[ \t]*```[ \t]*$|\Z)", re.M | re.S)
_PY_TAGS = {"python", "py", "python3", "py3"}


def extract_code(text: str) -> str:
    """The code in a completion: last ```python block, else last untagged block, else the text."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]
    for wanted in (lambda t: t in _PY_TAGS, lambda t: t == ""):
        chosen = [body for tag, body in blocks if wanted(tag)]
        if chosen:
            return chosen[-1]
    return text


def normalise_output(text: str) -> str:
    """Output as compared: CRLF -> LF, trailing whitespace per line and blank edge lines dropped."""
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    return "\n".join(lines).strip("\n")


@dataclass
class TestSpec:
    """A parsed test specification: ``kind`` is ``"io"`` (``cases`` of (input, output)) or
    ``"assert"`` (``steps``: ``("setup", source)`` run in order but never counted, and
    ``("test", source)``, each one test)."""

    kind: str
    cases: list[tuple[str, str]] = field(default_factory=list)
    steps: list[tuple[str, str]] = field(default_factory=list)

    @property
    def asserts(self) -> list[str]:
        """The sources of the counted tests (assert mode)."""
        return [src for kind, src in self.steps if kind == "test"]

    @property
    def total(self) -> int:
        return len(self.cases) if self.kind == "io" else len(self.asserts)


def _parse(source: str, where: str) -> ast.Module:
    try:
        return ast.parse(source)
    except SyntaxError as exc:
        raise ValueError(f"{where}: the assert tests are not valid Python: {exc}") from None


def _defined_functions(tree: ast.Module) -> set[str]:
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _is_test(node: ast.stmt, helpers: set[str]) -> bool:
    """A real test: a statement that asserts something, or a call of a test function the
    specification itself defines (``check(candidate)``). Definitions, imports, assignments
    (``METADATA = ...``) and other plain statements are setup: run, never counted."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return False
    if any(isinstance(n, ast.Assert) for n in ast.walk(node)):
        return True
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id in helpers
    )


def _program_steps(source: str, where: str, entry_point: str | None) -> list[tuple[str, str]]:
    """Steps of a test program given as one string: each top-level test statement is one test.

    A HumanEval-style program (defines ``check`` and never calls it) with an ``entry_point`` is
    ONE test: the whole program, then ``check(<entry_point>)``.
    """
    tree = _parse(source, where)
    helpers = _defined_functions(tree)
    lines = source.splitlines()
    steps = [
        (
            "test" if _is_test(node, helpers) else "setup",
            "\n".join(lines[node.lineno - 1 : node.end_lineno]),
        )
        for node in tree.body
    ]
    if "check" in helpers and not any(kind == "test" for kind, _ in steps):
        if not entry_point:
            raise ValueError(
                f"{where}: a HumanEval-style test program (it defines check() but calls nothing) "
                "needs the function to check: give an 'entry_point' column (or call check(...) "
                "in the test)"
            )
        if not entry_point.isidentifier():
            raise ValueError(f"{where}: entry_point {entry_point!r} is not a Python identifier")
        return [("setup", source), ("test", f"check({entry_point})")]
    if not any(kind == "test" for kind, _ in steps):
        raise ValueError(
            f"{where}: no test in the string (a test is an assert statement, or a call of a "
            "check function the string defines)"
        )
    return steps


def _list_steps(entries: list[str], where: str) -> list[tuple[str, str]]:
    """Steps of a list of test strings (MBPP's ``test_list``): each entry with a test in it is
    one test; the others (imports, helpers) are setup."""
    trees = [_parse(t, f"{where}[{j}]") for j, t in enumerate(entries)]
    helpers = set().union(*(_defined_functions(t) for t in trees))
    steps = [
        ("test" if any(_is_test(n, helpers) for n in tree.body) else "setup", src)
        for tree, src in zip(trees, entries)
    ]
    if not any(kind == "test" for kind, _ in steps):
        raise ValueError(f"{where}: none of the entries is a test (an assert statement)")
    return steps


def parse_tests(spec, *, index: int = 0, entry_point: str | None = None) -> TestSpec | None:
    """Parse one sample's ``tests`` entry (see the module docstring); ValueError if malformed.

    ``entry_point``: the function a HumanEval-style test program's ``check`` is given.
    """
    where = f"code_tests: tests[{index}]"
    expected = (
        "a list of {'input', 'output'} cases, {'inputs': [...], 'outputs': [...]}, "
        "assert statements (a string or a list of strings), a JSON string of one of these, "
        "or None"
    )
    if spec is None:
        return None
    if isinstance(spec, str):
        stripped = spec.strip()
        if stripped[:1] in ("[", "{"):
            try:
                spec = json.loads(stripped)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: looks like JSON but does not parse: {exc}") from None
        else:
            return TestSpec("assert", steps=_program_steps(spec, where, entry_point))
    if isinstance(spec, dict):
        ins = spec.get("inputs", spec.get("input"))
        outs = spec.get("outputs", spec.get("output"))
        if ins is None or outs is None:
            raise ValueError(
                f"{where}: a dict must have 'inputs' and 'outputs' (APPS) or 'input' and "
                f"'output' lists (CodeContests); expected {expected}"
            )
        if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs):
            raise ValueError(f"{where}: 'inputs' and 'outputs' must be lists of equal length")
        if spec.get("fn_name"):
            return _call_based(spec["fn_name"], ins, outs, where)
        spec = [{"input": i, "output": o} for i, o in zip(ins, outs)]
    if not isinstance(spec, list):
        raise ValueError(f"{where}: got {type(spec).__name__}; expected {expected}")
    if not spec:
        raise ValueError(f"{where}: empty test list (use None for a sample without tests)")
    if all(isinstance(t, str) for t in spec):
        return TestSpec("assert", steps=_list_steps(list(spec), where))
    cases = []
    for j, case in enumerate(spec):
        if not isinstance(case, dict) or "input" not in case or "output" not in case:
            raise ValueError(
                f"{where}[{j}]: expected a dict with 'input' and 'output' keys, got {case!r:.80}"
            )
        inp, out = case["input"], case["output"]
        if isinstance(inp, list):  # some datasets store lines
            inp = "\n".join(map(str, inp))
        if isinstance(out, list):
            out = "\n".join(map(str, out))
        if not isinstance(inp, str) or not isinstance(out, str):
            raise ValueError(f"{where}[{j}]: 'input' and 'output' must be strings")
        cases.append((inp, out))
    return TestSpec("io", cases=cases)


_APPS_CALL = """\
import json as _pg_json


def _pg_apps_case(name, args_json, want_json):
    fn = globals().get(name)
    if fn is None and "Solution" in globals():  # LeetCode-style rows: a Solution class
        fn = getattr(Solution(), name)
    got = fn(*_pg_json.loads(args_json))
    want = _pg_json.loads(want_json)
    if isinstance(got, tuple):
        got = list(got)
    # APPS stores a call's expected value wrapped in a list; either form is accepted.
    return got == want or (isinstance(want, list) and len(want) == 1 and got == want[0])
"""


def _call_based(fn_name, ins, outs, where: str) -> TestSpec:
    """APPS call-based rows (``fn_name``): each (arguments, expected value) pair is one test."""
    if not isinstance(fn_name, str) or not fn_name.isidentifier():
        raise ValueError(f"{where}: fn_name {fn_name!r} is not a Python identifier")
    steps = [("setup", _APPS_CALL)]
    for args, want in zip(ins, outs):
        args = args if isinstance(args, list) else [args]
        steps.append(
            (
                "test",
                f"assert _pg_apps_case({fn_name!r}, {json.dumps(args)!r}, {json.dumps(want)!r})",
            )
        )
    return TestSpec("assert", steps=steps)


TEST_FORMATS = ("auto", "tests", "humaneval", "mbpp", "apps", "codecontests")
"""``code_tests``' ``test_format`` values; see the module docstring for the columns each reads."""


def _column(columns: dict, name: str, n: int) -> list | None:
    col = columns.get(name)
    if col is None:
        return None
    if isinstance(col, (str, dict)) or len(col) != n:
        got = "a single value" if isinstance(col, (str, dict)) else f"{len(col)} entries"
        raise ValueError(
            f"code_tests: column {name!r} must be a list with one entry per completion ({n}), "
            f"got {got}"
        )
    return list(col)


def _detect_format(columns: dict) -> str:
    present = {k for k, v in columns.items() if v is not None}
    if "tests" in present:
        return "tests"
    if "input_output" in present:
        return "apps"
    if present & {"public_tests", "private_tests"}:
        return "codecontests"
    if "test" in present:
        return "humaneval"
    if "test_list" in present:
        return "mbpp"
    raise ValueError(
        "code_tests: needs test columns: 'tests' (one spec per completion), or a code dataset "
        "as it comes: HumanEval ('test' + 'entry_point'), MBPP ('test_list'), APPS "
        "('input_output') or CodeContests ('public_tests' / 'private_tests'); columns given: "
        f"{sorted(present) or 'none'}"
    )


def _specs(columns: dict, n: int, test_format: str) -> list[TestSpec | None]:
    """One TestSpec (or None: no tests) per completion, from the dataset's own columns."""
    fmt = _detect_format(columns) if test_format == "auto" else test_format
    entry = _column(columns, "entry_point", n) or [None] * n
    if fmt == "tests":
        tests = _column(columns, "tests", n)
        if tests is None:
            raise ValueError("code_tests: test_format 'tests' needs a 'tests' column")
        return [parse_tests(t, index=i, entry_point=entry[i]) for i, t in enumerate(tests)]
    if fmt == "humaneval":
        tests = _column(columns, "test", n)
        if tests is None or entry[0] is None and any(t is not None for t in tests):
            raise ValueError("code_tests: HumanEval rows need 'test' and 'entry_point' columns")
        out = []
        for i, (t, e) in enumerate(zip(tests, entry)):
            if t is None:
                out.append(None)
                continue
            if not isinstance(t, str) or not isinstance(e, str):
                raise ValueError(
                    f"code_tests: row {i}: HumanEval 'test' and 'entry_point' must be strings"
                )
            where = f"code_tests: test[{i}]"
            tree = _parse(t, where)
            if "check" not in _defined_functions(tree):
                raise ValueError(f"{where}: a HumanEval test program must define check()")
            if not e.isidentifier():
                raise ValueError(f"{where}: entry_point {e!r} is not a Python identifier")
            out.append(TestSpec("assert", steps=[("setup", t), ("test", f"check({e})")]))
        return out
    if fmt == "mbpp":
        tests = _column(columns, "test_list", n)
        if tests is None:
            raise ValueError("code_tests: MBPP rows need a 'test_list' column")
        setup = _column(columns, "test_setup_code", n) or [None] * n
        imports = _column(columns, "test_imports", n) or [None] * n
        out = []
        for i, t in enumerate(tests):
            if t is None:
                out.append(None)
                continue
            if not isinstance(t, list) or not t or not all(isinstance(x, str) for x in t):
                raise ValueError(
                    f"code_tests: test_list[{i}]: expected a non-empty list of assert strings"
                )
            pre = [("setup", "\n".join(imports[i] or []))] if imports[i] else []
            if setup[i]:
                pre.append(("setup", setup[i]))
            steps = _list_steps(t, f"code_tests: test_list[{i}]")
            out.append(TestSpec("assert", steps=pre + steps))
        return out
    if fmt == "apps":
        tests = _column(columns, "input_output", n)
        if tests is None:
            raise ValueError("code_tests: APPS rows need an 'input_output' column")
        return [None if t in (None, "") else parse_tests(t, index=i) for i, t in enumerate(tests)]
    if fmt == "codecontests":
        groups = [_column(columns, k, n) for k in ("public_tests", "private_tests")]
        out = []
        for i in range(n):
            cases: list[tuple[str, str]] = []
            for col in groups:
                entry = col[i] if col is not None else None
                if isinstance(entry, dict) and not entry.get("input"):
                    entry = None  # CodeContests rows often have no private tests
                if entry:
                    spec = parse_tests(entry, index=i)
                    cases += spec.cases if spec is not None else []
            out.append(TestSpec("io", cases=cases) if cases else None)
        return out
    raise ValueError(f"code_tests: test_format must be one of {TEST_FORMATS}, got {test_format!r}")


_HARNESS = """\
import json as _json
import os as _os
import sys as _sys


def _pg_run():
    with open("nonce.txt") as f:
        nonce = f.read().strip()
    _os.unlink("nonce.txt")
    # the tests live in a file removed before the candidate runs, never in this source
    # (a candidate that reads main.py would find their expected values)
    with open("steps.json") as f:
        steps = _json.load(f)
    _os.unlink("steps.json")
    out = _os.dup(1)

    def say(line):
        try:
            _os.write(out, (nonce + " " + line + "\\n").encode("utf-8", "replace"))
        except OSError:
            pass

    def plain(v, depth=0):
        # Refuse values whose class, written by the candidate, defines its own comparison
        # (the "always equal" hack); look inside builtin containers a few levels deep.
        for k in type(v).__mro__:
            if k.__module__ == "solution" and ("__eq__" in vars(k) or "__ne__" in vars(k)):
                raise AssertionError("compared a %s, which defines its own __eq__" % k.__name__)
        if depth < 3 and isinstance(v, (list, tuple, set, frozenset)):
            for x in list(v)[:1000]:
                plain(x, depth + 1)
        elif depth < 3 and isinstance(v, dict):
            for x in list(v.items())[:1000]:
                plain(x, depth + 1)
        return v

    g = {{"__name__": "solution", "__builtins__": __builtins__}}
    try:
        exec(compile({code!r}, "solution.py", "exec"), g)
    except BaseException as exc:
        say("load " + type(exc).__name__ + ": " + str(exc)[:200].replace("\\n", " "))
        raise
    # The tests see the candidate's names, but never its shadows of builtins (a candidate
    # `abs` that returns 0 would pass `assert abs(f(x) - y) < 1e-6`).
    import builtins as _b
    t = {{k: v for k, v in g.items() if not hasattr(_b, k)}}
    t.update(__name__="tests", __builtins__=_b)
    i = 0
    for kind, src in steps:
        t[{checker!r}] = plain  # set after the candidate ran, so it cannot replace it
        try:
            exec(compile(src, "<test %d>" % i, "exec"), t)
        except BaseException as exc:
            why = "%s: %s" % (type(exc).__name__, str(exc)[:200].replace("\\n", " "))
            say(("%d fail " % i if kind == "test" else "setup ") + why)
        else:
            if kind == "test":
                say("%d pass" % i)
        i += kind == "test"


_pg_run()
"""


class _GuardComparisons(ast.NodeTransformer):
    """Wrap every operand of a comparison in a call to the harness's ``plain`` check."""

    def __init__(self, checker: str):
        self.checker = checker

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)

        def wrap(e: ast.expr) -> ast.expr:
            return ast.Call(func=ast.Name(id=self.checker, ctx=ast.Load()), args=[e], keywords=[])

        node.left = wrap(node.left)
        node.comparators = [wrap(c) for c in node.comparators]
        return node


def _assert_job(code: str, steps: list[tuple[str, str]]) -> tuple[dict, str]:
    nonce = secrets.token_hex(16)
    checker = f"_pg_plain_{secrets.token_hex(4)}"
    guarded = []
    for kind, src in steps:
        tree = _GuardComparisons(checker).visit(ast.parse(src))
        guarded.append((kind, ast.unparse(ast.fix_missing_locations(tree))))
    program = _HARNESS.format(code=code, checker=checker)
    files = {"nonce.txt": nonce, "steps.json": json.dumps(guarded)}
    return {"code": program, "files": files}, nonce


def _score_asserts(res: SandboxResult, nonce: str, total: int) -> tuple[int, list[str]]:
    passed: set[int] = set()
    failed: set[int] = set()
    reasons: list[str] = []
    for line in res.stdout.splitlines():
        if not line.startswith(nonce + " "):
            continue  # the candidate's own output, or a forged report without the nonce
        head, _, rest = line[len(nonce) + 1 :].partition(" ")
        if head == "load":
            reasons.append(f"solution failed to load: {rest}")
        elif head == "setup":
            reasons.append(f"test setup failed: {rest}")
        elif head.isdigit() and int(head) < total:
            verdict, _, why = rest.partition(" ")
            if verdict == "pass":
                passed.add(int(head))
            else:
                failed.add(int(head))
                reasons.append(f"test {head}: {why}")
    passed -= failed  # a test reported both ways (it cannot be, unless forged) fails
    if res.status != "ok":
        reasons.append(f"{res.status}: {res.reason}")
    unreported = total - len(passed | failed)
    if unreported and res.status == "ok":
        reasons.append(f"{unreported} test(s) never reported (the program exited early)")
    return len(passed), reasons


class SandboxError(RewardSampleErrors):
    """Some programs could not be run by the sandbox (``status == "sandbox_error"``): their
    samples are not scored (never silently 0); the rest are in ``scores``."""


def _with_prompt(code: str, prompt, entry_point) -> str:
    """HumanEval completion style: a completion that only continues the prompt's function
    (it does not define ``entry_point`` itself) runs after the prompt's code."""
    if not entry_point or not isinstance(prompt, str) or f"def {entry_point}" not in prompt:
        return code
    try:
        if entry_point in _defined_functions(ast.parse(code)):
            return code
    except SyntaxError:
        pass  # an indented function body on its own does not parse
    joined = prompt + code
    try:
        if entry_point in _defined_functions(ast.parse(joined)):
            return joined
    except SyntaxError:
        pass
    return code


def _preflight(sandbox: str = "auto", **_kwargs) -> None:
    """Before the first step: the sandbox self-test (fail closed), or the unsandboxed warning."""
    require_sandbox(sandbox)


def _plan_jobs(codes: list[str], specs: list[TestSpec | None]):
    """The sandbox jobs for every (program, tests) pair, identical work run once: (jobs, the
    nonce of each assert job by job index, each sample's job indices or None without tests)."""
    jobs: list[dict] = []
    job_of: dict[tuple, int] = {}  # dedup identical (code, test) work across the batch
    nonces: dict[int, str] = {}
    plan: list[list[int] | None] = []
    for code, spec in zip(codes, specs):
        if spec is None:
            plan.append(None)
        elif spec.kind == "io":
            ids = []
            for inp, _ in spec.cases:
                key = ("io", code, inp)
                if key not in job_of:
                    job_of[key] = len(jobs)
                    jobs.append({"code": code, "stdin": inp})
                ids.append(job_of[key])
            plan.append(ids)
        else:
            key = ("assert", code, tuple(spec.steps))
            if key not in job_of:
                job, nonce = _assert_job(code, spec.steps)
                job_of[key] = len(jobs)
                nonces[len(jobs)] = nonce
                jobs.append(job)
            plan.append([job_of[key]])
    return jobs, nonces, plan


def _passed_tests(spec: TestSpec, ids: list[int], results, nonces) -> tuple[int, list[str]]:
    """How many of one sample's tests passed (0 if it tampered with its sandbox), and why the
    others failed."""
    reasons: list[str] = []
    if spec.kind == "io":
        passed = 0
        for j, ((_, expected), job_id) in enumerate(zip(spec.cases, ids)):
            res = results[job_id]
            if res.status != "ok":
                reasons.append(f"case {j}: {res.status}: {res.reason}")
            elif normalise_output(res.stdout) != normalise_output(expected):
                reasons.append(f"case {j}: wrong output")
            else:
                passed += 1
    else:
        res = results[ids[0]]
        passed, reasons = _score_asserts(res, nonces[ids[0]], spec.total)
    if any(results[k].status == "tampered" for k in ids):
        # An attack on the sandbox itself voids whatever the program passed before it.
        passed = 0
        reasons.append("the program tampered with its sandbox: the sample scores 0")
    return passed, reasons


def _score_samples(specs, plan, results, nonces, mode: str) -> tuple[list, list[dict]]:
    """Each sample's reward (None without tests) and its report entry (tests passed, statuses,
    reasons)."""
    rewards: list[float | None] = []
    report: list[dict] = []
    for i, (spec, ids) in enumerate(zip(specs, plan)):
        if spec is None:
            rewards.append(None)
            report.append(
                {
                    "index": i,
                    "reward": None,
                    "passed": 0,
                    "total": 0,
                    "statuses": {},
                    "reasons": ["no tests"],
                }
            )
            continue
        passed, reasons = _passed_tests(spec, ids, results, nonces)
        total = spec.total
        if mode == "fraction":
            reward = passed / total
        elif mode == "all":
            reward = 1.0 if passed == total else 0.0
        rewards.append(reward)
        report.append(
            {
                "index": i,
                "reward": reward,
                "passed": passed,
                "total": total,
                "statuses": dict(Counter(results[k].status for k in ids)),
                "reasons": reasons,
            }
        )
    return rewards, report


def _sandbox_failures(plan: list[list[int] | None], results) -> dict[int, str]:
    """Sample index -> why, for the samples with a program the sandbox could not run."""
    return {
        i: "sandbox error (the program never ran): "
        + next(results[k].reason for k in ids if results[k].status == "sandbox_error")
        for i, ids in enumerate(plan)
        if ids and any(results[k].status == "sandbox_error" for k in ids)
    }


def code_tests(
    prompts,
    completions,
    tests=None,
    *,
    mode: str = "fraction",
    test_format: str = "auto",
    sandbox: str = "auto",
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 64_000,
    workers: int | None = None,
    **columns,
) -> list[float | None]:
    """Fraction (``mode="fraction"``) or all-or-nothing (``mode="all"``) of tests passed.

    ``tests``: the dataset column, one spec per completion (see the module docstring); or, with
    ``test_format`` ``"auto"`` (detected from the columns) or named, a code dataset's own
    columns (HumanEval, MBPP, APPS, CodeContests). ``sandbox``: ``"auto"`` (fail closed: the
    self-test must pass), ``"root"`` / ``"userns"`` (force one mechanism) or ``"none"``
    (unsandboxed, warned about on every call). ``timeout_s`` / ``memory_mb`` /
    ``max_output_bytes``: sandbox limits per process. ``workers``: programs run at once
    (default: the number of CPUs, at most 8). Raises ``SandboxError`` (carrying the other
    samples' scores) when some programs could not be run by the sandbox.
    """
    global last_report
    if mode not in ("fraction", "all"):
        raise ValueError(f"code_tests: mode must be 'fraction' or 'all', got {mode!r}")
    if test_format not in TEST_FORMATS:
        raise ValueError(
            f"code_tests: test_format must be one of {TEST_FORMATS}, got {test_format!r}"
        )
    if sandbox not in MECHANISMS:
        raise ValueError(f"code_tests: sandbox must be one of {MECHANISMS}, got {sandbox!r}")
    n = len(completions)
    specs = _specs({**columns, "tests": tests}, n, test_format)
    mechanism = require_sandbox(sandbox)  # cached after the first success; warns for "none"
    entry = _column(columns, "entry_point", n) or [None] * n
    prompt_list = list(prompts) if prompts is not None and len(prompts) == n else [None] * n
    codes = [
        _with_prompt(extract_code(completion_text(c)), p, e)
        for c, p, e in zip(completions, prompt_list, entry)
    ]

    jobs, nonces, plan = _plan_jobs(codes, specs)
    n_workers = workers if workers is not None else min(8, os.cpu_count() or 1)
    limits = SandboxLimits(
        timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes
    )
    results = run_many(jobs, workers=max(1, n_workers), limits=limits, mechanism=mechanism)

    rewards, report = _score_samples(specs, plan, results, nonces, mode)
    last_report = report
    failed = _sandbox_failures(plan, results)
    if failed:
        for i in failed:
            rewards[i] = None
            report[i]["reward"] = None
        first = next(iter(failed.items()))
        raise SandboxError(
            f"code_tests: {len(failed)} of {n} samples could not be run by the sandbox "
            f"(sample {first[0]}: {first[1]})",
            rewards,
            failed,
            kind="sandbox_errors",
        )
    return rewards


code_tests.preflight = _preflight  # run by make_reward_spec, before the first step
code_tests.error_metrics = ("sandbox_errors",)  # reward/code_tests/sandbox_errors, every step
