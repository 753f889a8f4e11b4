"""Answer-checking rewards: ``arithmetic`` (exact integers) and ``math_accuracy`` (math-verify).

Both follow the reward contract of ``peergrade.rewards.registry``:
``fn(prompts, completions, *, answer, **columns) -> list[float]``, one score per completion,
1.0 for a correct final answer and 0.0 otherwise. ``answer`` is the dataset's reference column.

``arithmetic`` (the verifier of the built-in ``arithmetic`` task)
    The answer is picked by ``extract``:

    - ``"auto"`` (default): if the completion contains an ``<answer>`` or ``</answer>`` tag, the
      content of exactly one ``<answer>...</answer>`` block; otherwise the whole completion,
      stripped. So a base model that writes ``"12"`` and an instruct model that writes
      ``"... <answer>12</answer>"`` are both graded, but a tag cannot be half-used.
    - ``"tag"``: exactly one ``<answer>`` block is required.
    - ``"whole"``: the whole completion, stripped.
    - ``"last_number"``: the last number in the text (lenient: "12 or 13" scores as 13; opt-in).

    The picked text must be one integer (``peergrade.rewards.extract.parse_int``): a sign, digits,
    and optionally comma grouping in exact groups of three ("1,234" is accepted, "12,34" is not).
    Reward-hacking guards: several ``<answer>`` blocks, "12 13", "[12, 13]", "12, 13" and any
    other multiple or non-integer answer score 0.

``math_accuracy`` (free-form math answers: GSM8K, MATH, ...)
    The answer is picked by ``extract``:

    - ``"auto"`` (default): the single ``<answer>`` block if the text has an answer tag; else the
      ``\\boxed{}`` content if the text has a box; else the last number in the text.
    - ``"tag"``, ``"boxed"``, ``"last_number"``, ``"whole"``: only that rule.

    Guards: several ``<answer>`` blocks, or ``\\boxed{}`` repeated with different contents,
    give no answer (``allow_multiple_boxed=True`` lets the last box win). The picked text is
    parsed as ONE expression (it is wrapped in ``\\boxed{...}`` before ``math_verify.parse``),
    so "3 or 4" and "3, 4" become the set {3, 4}, which does not equal 4. ``last_number`` is
    lenient by nature: "3 or 4" reads as 4 (the last number), but a list never scores better
    than its last element alone would.

    Equivalence: exact match after whitespace/``$`` normalisation, else ``math_verify``
    (LaTeX, fractions, sets, intervals, equations ``x=4`` vs ``4``, percentages) with its own
    timeouts disabled, else, when ``math_verify`` is missing or raises, a small sympy fallback
    (exact rational comparison of plain numbers, ``a/b`` and ``\\frac{a}{b}``; no
    ``sympify``/``parse_expr``, which would ``eval`` text).

    Time limit (``timeout_s`` per check, default 3 s): a check that runs past it scores 0.
    In the main thread of a POSIX process the limit is a ``SIGALRM`` interval timer
    (``signal.setitimer``), restored afterwards, whose exception derives from ``BaseException``
    so library code catching ``Exception`` cannot swallow it. The checkers (math-verify, sympy)
    are imported before the timer starts, and a timer that fires during an import waits for it
    to finish: an import cut short would leave sympy half-imported for the whole process. Signals can only be handled in
    the main thread, so from any other thread the check runs in a long-lived helper process
    (``python -m peergrade.rewards.math``, JSON lines over pipes) that is killed and restarted
    when a check runs past the limit. (math-verify's own ``signal.alarm`` timeouts are integer
    seconds, refuse to run off the main thread, and would cancel our timer, hence disabled.)

    Memo: math-verify's parse (most of a check's time) is kept per distinct text, and the verdict
    per distinct (answer, reference) pair, in bounded LRU memos (4096 entries each, texts up to
    1000 characters), so a batch parses each reference once and repeated answers cost nothing.
    Both are pure functions of their texts; a check cut off by the time limit stores nothing.
    ``clear_caches()`` empties them.

This module does not generate problems (``peergrade.tasks``) and never evaluates model text.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
from collections import OrderedDict
from fractions import Fraction

from peergrade.limits import importing

from .extract import answer_tag, boxed, completion_text, last_number, parse_int

__all__ = [
    "arithmetic",
    "clear_caches",
    "extract_integer",
    "extract_math_answer",
    "is_equivalent",
    "math_accuracy",
]


def extract_integer(text: str, extract: str = "auto") -> int | None:
    """The integer answer in ``text`` under the rule ``extract``, or ``None`` if there is none."""
    if extract == "auto":
        if "<answer>" in text or "</answer>" in text:
            return parse_int(answer_tag(text))
        return parse_int(text)
    elif extract == "tag":
        return parse_int(answer_tag(text))
    elif extract == "whole":
        return parse_int(text)
    elif extract == "last_number":
        return parse_int(last_number(text))
    else:
        raise ValueError(
            f"extract={extract!r} is not a valid choice; expected one of "
            "'auto', 'tag', 'whole', 'last_number'"
        )


def arithmetic(prompts, completions, answer=None, *, extract: str = "auto", **_columns):
    """1.0 where the completion's integer answer equals ``answer``, else 0.0 (see module doc)."""
    if answer is None:
        raise ValueError(
            "the 'arithmetic' reward needs an 'answer' column (the reference integer per sample)"
        )
    if len(answer) != len(completions):
        raise ValueError(
            f"'answer' has {len(answer)} entries but there are {len(completions)} completions"
        )
    scores = []
    for i, (completion, ref) in enumerate(zip(completions, answer)):
        expected = (
            ref if isinstance(ref, int) and not isinstance(ref, bool) else parse_int(str(ref))
        )
        if expected is None:
            raise ValueError(f"sample {i}: reference answer {ref!r} is not an integer")
        got = extract_integer(completion_text(completion), extract)
        scores.append(1.0 if got is not None and got == expected else 0.0)
    return scores


# ------------------------------------------------------------------------------ math_accuracy


def extract_math_answer(text: str, extract: str = "auto", *, allow_multiple_boxed: bool = False):
    """The answer text in ``text`` under the rule ``extract`` (see module doc), or ``None``."""
    if extract == "auto":
        if "<answer>" in text or "</answer>" in text:
            return answer_tag(text) or None
        if re.search(r"\\(?:boxed|fbox)\b", text):
            return boxed(text, allow_multiple=allow_multiple_boxed) or None
        return last_number(text)
    elif extract == "tag":
        return answer_tag(text) or None
    elif extract == "boxed":
        return boxed(text, allow_multiple=allow_multiple_boxed) or None
    elif extract == "last_number":
        return last_number(text)
    elif extract == "whole":
        return text.strip() or None
    else:
        raise ValueError(
            f"extract={extract!r} is not a valid choice; expected one of "
            "'auto', 'tag', 'boxed', 'last_number', 'whole'"
        )


def _normalise(s: str) -> str:
    s = s.strip().replace("\u2212", "-")
    s = s.strip("$").strip()
    s = re.sub(r"\\[,!;: ]", "", s)  # LaTeX spacing commands
    s = s.replace("\\left", "").replace("\\right", "")
    s = re.sub(r"\s+", "", s)
    return s.rstrip(".")


def _as_fraction(s: str) -> Fraction | None:
    s = _normalise(s)
    m = re.fullmatch(r"(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}", s, re.ASCII)
    if m:
        s = f"{m.group(1)}{m.group(2)}/{m.group(3)}"
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s, re.ASCII):
        s = s.replace(",", "")
    if not re.fullmatch(r"[+-]?(\d+(\.\d*)?|\.\d+)(/\d+)?", s, re.ASCII):
        return None
    import sympy

    try:
        r = sympy.Rational(s)  # string parsing, no eval
    except (TypeError, ValueError, ZeroDivisionError):
        return None
    return Fraction(int(r.p), int(r.q))


def _sympy_equivalent(pred: str, gold: str) -> bool:
    a, b = _as_fraction(pred), _as_fraction(gold)
    return a is not None and b is not None and a == b


class _MathVerifyLogFilter(logging.Filter):
    def filter(self, record):  # we disable math-verify's timeouts on purpose (see module doc)
        return "Timeout is disabled" not in record.getMessage()


_MV = None  # (parse, verify) once imported, False if math_verify is missing


def _math_verify():
    global _MV
    if _MV is None:
        try:
            from math_verify import parse, verify
        except ImportError:
            _MV = False
        else:
            for name in ("math_verify.parser", "math_verify.grader", "math_verify.utils"):
                logging.getLogger(name).addFilter(_MathVerifyLogFilter())
            _MV = (parse, verify)
    return _MV


def _as_latex(s: str) -> str:
    return s if "\\boxed" in s or s.startswith("$") else "\\boxed{" + s + "}"


class _Memo:
    """A bounded LRU of a pure function's results, keyed by its text argument(s).

    Nothing is stored from a call our time limit interrupted, even if library code swallowed
    the interruption; long keys are not stored (rarely repeated, and memory).
    """

    def __init__(self, size: int = 4096, max_chars: int = 1000):
        self.size, self.max_chars = size, max_chars
        self.items: OrderedDict = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key, compute):
        with self.lock:
            if key in self.items:
                self.items.move_to_end(key)
                return self.items[key]
        alarms = _alarms_fired
        value = compute()
        if alarms == _alarms_fired and sum(map(len, key)) <= self.max_chars:
            with self.lock:
                self.items[key] = value
                if len(self.items) > self.size:
                    self.items.popitem(last=False)
        return value

    def clear(self):
        with self.lock:
            self.items.clear()


# math_verify.parse (latex2sympy) is most of a check's time and, with its own timeouts off, a
# pure function of its text; its own cache keeps 20 entries, too few for a batch whose rows have
# different references. So: one parse per distinct text (the reference is parsed once, not once
# per completion), and one verdict per distinct (answer, reference) pair.
_PARSED = _Memo()
_VERDICTS = _Memo()
_alarms_fired = 0  # counted by _alarm, so a memo never keeps an interrupted result


def clear_caches() -> None:
    """Forget the memoised parses and verdicts (benchmarks measuring a cold start)."""
    _PARSED.clear()
    _VERDICTS.clear()


def _parse(parse, latex: str) -> list:
    # a tuple in the memo and a fresh list out, so a caller mutating the list cannot poison it
    return list(_PARSED.get((latex,), lambda: tuple(parse(latex, parsing_timeout=None))))


def _equivalent_untimed(pred: str, gold: str) -> bool:
    return _VERDICTS.get((pred, gold), lambda: _equivalent_uncached(pred, gold))


def _equivalent_uncached(pred: str, gold: str) -> bool:
    if _normalise(pred) == _normalise(gold):
        return True
    mv = _math_verify()
    if mv:
        parse, verify = mv
        try:
            g = _parse(parse, _as_latex(gold))
            p = _parse(parse, _as_latex(pred))
            if g and p:
                return bool(verify(g, p, timeout_seconds=None))
            return _sympy_equivalent(pred, gold)
        except Exception:
            pass
    return _sympy_equivalent(pred, gold)


class CheckTimeout(BaseException):
    """A check ran past its time limit (a BaseException so ``except Exception`` cannot eat it)."""


def _alarm(signum, frame):
    global _alarms_fired
    if importing(frame):  # never cut an import (a half-imported sympy breaks the process)
        signal.setitimer(signal.ITIMER_REAL, 0.05)  # ask again once it is done
        return
    _alarms_fired += 1
    raise CheckTimeout


def _import_checkers() -> None:
    """math-verify and sympy imported (seconds on a busy machine), before any time limit."""
    if _math_verify():
        return
    import sympy  # noqa: F401  (the fallback's)


def _equivalent_with_signal(pred: str, gold: str, timeout_s: float) -> bool:
    _import_checkers()  # import time is not check time, and no alarm may cut an import
    old_handler = signal.signal(signal.SIGALRM, _alarm)
    old_timer = signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return _equivalent_untimed(pred, gold)
    except CheckTimeout:
        return False
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_timer[0] > 0:  # someone else's timer was running: give it back
            signal.setitimer(signal.ITIMER_REAL, *old_timer)


class _Worker:
    """A helper process that checks equivalence; killed and restarted after a timeout."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def _start(self):
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH", "HOME", "LANG")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "peergrade.rewards.math"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
            bufsize=1,
        )

    def _kill(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def check(self, pred: str, gold: str, timeout_s: float, startup_s: float = 60.0) -> bool:
        with self.lock:
            first = self.proc is None or self.proc.poll() is not None
            if first:
                self._start()
            try:
                self.proc.stdin.write(json.dumps([pred, gold]) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                self._kill()
                return False
            # the first check also waits for the interpreter and sympy to import
            limit = timeout_s + (startup_s if first else 0.0)
            ready, _, _ = select.select([self.proc.stdout], [], [], limit)
            if not ready:
                self._kill()
                return False
            line = self.proc.stdout.readline()
            if not line:
                self._kill()
                return False
            return bool(json.loads(line))


_WORKER = _Worker()


def is_equivalent(pred: str, gold: str, timeout_s: float | None = 3.0) -> bool:
    """Whether answer ``pred`` equals reference ``gold`` within ``timeout_s`` (False past it)."""
    if timeout_s is None or timeout_s <= 0:
        return _equivalent_untimed(pred, gold)
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        return _equivalent_with_signal(pred, gold, timeout_s)
    return _WORKER.check(pred, gold, timeout_s)


def math_accuracy(
    prompts,
    completions,
    answer=None,
    *,
    extract: str = "auto",
    allow_multiple_boxed: bool = False,
    timeout_s: float = 3.0,
    **_columns,
):
    """1.0 where the completion's final answer is equivalent to ``answer``, else 0.0."""
    if answer is None:
        raise ValueError("the 'math_accuracy' reward needs an 'answer' column (reference answers)")
    if len(answer) != len(completions):
        raise ValueError(
            f"'answer' has {len(answer)} entries but there are {len(completions)} completions"
        )
    scores = []
    for completion, ref in zip(completions, answer):
        pred = extract_math_answer(
            completion_text(completion), extract, allow_multiple_boxed=allow_multiple_boxed
        )
        if pred is None or ref is None:
            scores.append(0.0)
            continue
        scores.append(1.0 if is_equivalent(pred, str(ref), timeout_s) else 0.0)
    return scores


def _worker_main() -> None:
    """The helper-process loop: one JSON ``[pred, gold]`` per line in, ``true|false`` out."""
    for line in sys.stdin:
        try:
            pred, gold = json.loads(line)
            ok = _equivalent_untimed(str(pred), str(gold))
        except Exception:
            ok = False
        sys.stdout.write("true\n" if ok else "false\n")
        sys.stdout.flush()


# checked against the dataset before the model loads (rewards.required_columns): a row whose
# answer is missing would otherwise just score 0
arithmetic.required_columns = ("answer",)
math_accuracy.required_columns = ("answer",)


if __name__ == "__main__":
    _worker_main()
