"""``code_tests``: reward a completion by running its code against the sample's tests.

TRL-style signature: ``code_tests(prompts, completions, tests, **columns) -> list[float | None]``.
Every program runs in ``peergrade.rewards.sandbox`` (separate process, limits, no network, ...).

Code extraction (``extract_code``): the last fenced block tagged ``python``/``py``/``python3``;
else the last fenced block with no language tag; else the whole completion text. A fence left
open at the very end (a truncated generation) counts as a block running to the end of the text.
Blocks tagged with another language (```bash, ```text) are never taken.

Test specifications (the ``tests`` column, one entry per sample; a JSON string of any of these
is accepted too):

- stdin/stdout cases: ``[{"input": "...", "output": "..."}, ...]`` or the APPS/TACO layout
  ``{"inputs": [...], "outputs": [...]}``. One process per case, with the case's input on stdin.
  A case passes when the program exits 0 and its output equals the expected output after
  normalisation: ``\\r\\n`` -> ``\\n``, trailing whitespace removed from every line, and leading and
  trailing blank lines removed (``normalise_output``).
- assert statements: a string (one or more lines of Python, each top-level statement being one
  test) or a list of strings (each entry one test). One process per sample: a harness runs the
  candidate's code as module ``solution`` (so an ``if __name__ == "__main__":`` block does NOT
  run), then each test in that namespace, reporting each one on stdout tagged with a random
  nonce the program cannot see in its source or stdin (the harness reads it from a file that it
  deletes before the candidate runs). A test passes when it ran without raising (SystemExit
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
test, never raises.

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
from dataclasses import dataclass

from .extract import completion_text
from .sandbox import SandboxResult, run_many

__all__ = ["code_tests", "extract_code", "normalise_output", "parse_tests", "last_report"]

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
    ``"assert"`` (``asserts``: one source string per test)."""

    kind: str
    cases: list[tuple[str, str]]
    asserts: list[str]

    @property
    def total(self) -> int:
        return len(self.cases) if self.kind == "io" else len(self.asserts)


def _split_statements(source: str, where: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise ValueError(f"{where}: the assert tests are not valid Python: {exc}") from None
    lines = source.splitlines()
    return [
        "\n".join(lines[node.lineno - 1 : node.end_lineno]) for node in tree.body
    ]  # each top-level statement is one test


def parse_tests(spec, *, index: int = 0) -> TestSpec | None:
    """Parse one sample's ``tests`` entry (see the module docstring); ValueError if malformed."""
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
            stmts = _split_statements(spec, where)
            if not stmts:
                raise ValueError(f"{where}: no test statements in the string")
            return TestSpec("assert", [], stmts)
    if isinstance(spec, dict):
        if set(spec) >= {"inputs", "outputs"}:
            ins, outs = spec["inputs"], spec["outputs"]
            if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs):
                raise ValueError(f"{where}: 'inputs' and 'outputs' must be lists of equal length")
            spec = [{"input": i, "output": o} for i, o in zip(ins, outs)]
        else:
            raise ValueError(
                f"{where}: a dict must have 'inputs' and 'outputs'; expected {expected}"
            )
    if not isinstance(spec, list):
        raise ValueError(f"{where}: got {type(spec).__name__}; expected {expected}")
    if not spec:
        raise ValueError(f"{where}: empty test list (use None for a sample without tests)")
    if all(isinstance(t, str) for t in spec):
        for j, t in enumerate(spec):
            _split_statements(t, f"{where}[{j}]")
        return TestSpec("assert", [], list(spec))
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
    return TestSpec("io", cases, [])


_HARNESS = """\
import os as _os
import sys as _sys


def _pg_run():
    with open("nonce.txt") as f:
        nonce = f.read().strip()
    _os.unlink("nonce.txt")
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
    for i, test in enumerate({tests!r}):
        g[{checker!r}] = plain  # set after the candidate ran, so it cannot replace it
        try:
            exec(compile(test, "<test %d>" % i, "exec"), g)
        except BaseException as exc:
            say("%d fail %s: %s" % (i, type(exc).__name__, str(exc)[:200].replace("\\n", " ")))
        else:
            say("%d pass" % i)


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


def _assert_job(code: str, asserts: list[str]) -> tuple[dict, str]:
    nonce = secrets.token_hex(16)
    checker = f"_pg_plain_{secrets.token_hex(4)}"
    guarded = []
    for test in asserts:
        tree = _GuardComparisons(checker).visit(ast.parse(test))
        guarded.append(ast.unparse(ast.fix_missing_locations(tree)))
    program = _HARNESS.format(code=code, tests=guarded, checker=checker)
    return {"code": program, "files": {"nonce.txt": nonce}}, nonce


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


def code_tests(
    prompts,
    completions,
    tests=None,
    *,
    mode: str = "fraction",
    timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_output_bytes: int = 64_000,
    workers: int | None = None,
    **_columns,
) -> list[float | None]:
    """Fraction (``mode="fraction"``) or all-or-nothing (``mode="all"``) of tests passed.

    ``tests``: the dataset column, one spec per completion (see the module docstring).
    ``timeout_s`` / ``memory_mb`` / ``max_output_bytes``: sandbox limits per process.
    ``workers``: programs run at once (default: the number of CPUs, at most 8).
    """
    global last_report
    if mode not in ("fraction", "all"):
        raise ValueError(f"code_tests: mode must be 'fraction' or 'all', got {mode!r}")
    if tests is None:
        raise ValueError("code_tests: needs a 'tests' column (one test spec per completion)")
    if isinstance(tests, (str, dict)) or len(tests) != len(completions):
        n = "a single spec" if isinstance(tests, (str, dict)) else f"{len(tests)} entries"
        raise ValueError(
            f"code_tests: 'tests' must be a list with one entry per completion "
            f"({len(completions)}), got {n}"
        )
    specs = [parse_tests(t, index=i) for i, t in enumerate(tests)]
    codes = [extract_code(completion_text(c)) for c in completions]

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
            key = ("assert", code, tuple(spec.asserts))
            if key not in job_of:
                job, nonce = _assert_job(code, spec.asserts)
                job_of[key] = len(jobs)
                nonces[len(jobs)] = nonce
                jobs.append(job)
            plan.append([job_of[key]])

    n_workers = workers if workers is not None else min(8, os.cpu_count() or 1)
    results = run_many(
        jobs,
        workers=max(1, n_workers),
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        max_output_bytes=max_output_bytes,
    )

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
    last_report = report
    return rewards
