"""The ``countdown`` reward: an arithmetic equation over given numbers that hits a target.

``countdown(prompts, completions, *, target, numbers, extract="auto", use_all=True)``
scores 1.0 when the completion's equation uses the given numbers (a multiset: each exactly
once) and evaluates exactly to ``target``; else 0.0.

Extraction (``extract``): ``"auto"`` takes the single ``<answer>`` block when the text has an
answer tag, else the whole completion; ``"tag"`` requires one ``<answer>`` block; ``"whole"``
uses the whole completion. Several ``<answer>`` blocks give no answer. The equation may end
with ``= <target>`` (e.g. ``(3 + 5) * 2 = 16``); a right-hand side other than the target fails.

Checking, never ``eval``: the text is parsed with ``ast.parse(mode="eval")`` and only these
nodes are accepted: integer literals, binary ``+ - * /`` and parentheses. Rejected: unary
minus/plus, ``**`` (so no huge exponents), ``//``, ``%``, floats, names, calls, anything else.
Evaluation uses exact fractions (``/`` is true division: 7 / 2 = 7/2), division by zero
scores 0, and an intermediate value above 10**15 in magnitude or an equation longer than
``MAX_CHARS`` scores 0 (bounded work whatever the model writes).

Reward-hacking guards: the literals must equal the given numbers as a multiset, so a reused
number, a missing number (with ``use_all=True``, the default; ``use_all=False`` allows a
subset, each still at most once), a number not given, or digits glued together ("12" from 1
and 2) all score 0.

This module does not generate problems (``peergrade.tasks.countdown`` does).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction

from .extract import answer_tag, completion_text

__all__ = ["countdown", "check_equation", "MAX_CHARS"]

MAX_CHARS = 500
MAX_ABS = 10**15


class _Reject(Exception):
    pass


def _eval(node) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if type(node.value) is not int:
            raise _Reject(f"literal {node.value!r} is not an integer")
        return Fraction(node.value)
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Add):
            out = left + right
        elif isinstance(node.op, ast.Sub):
            out = left - right
        elif isinstance(node.op, ast.Mult):
            out = left * right
        elif isinstance(node.op, ast.Div):
            if right == 0:
                raise _Reject("division by zero")
            out = left / right
        else:
            raise _Reject(f"operator {type(node.op).__name__} is not allowed")
        if abs(out) > MAX_ABS:
            raise _Reject("intermediate value too large")
        return out
    raise _Reject(f"{type(node).__name__} is not allowed")


def _literals(tree) -> list[int]:
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)]


def check_equation(expr: str, target: int, numbers, *, use_all: bool = True) -> bool:
    """Whether ``expr`` (optionally ``... = target``) uses ``numbers`` and equals ``target``."""
    if not isinstance(expr, str):
        return False
    expr = expr.strip().replace("\u00d7", "*").replace("\u00f7", "/").replace("\u2212", "-")
    if not expr or len(expr) > MAX_CHARS:
        return False
    if "=" in expr:
        parts = expr.split("=")
        if len(parts) != 2 or not re.fullmatch(r"\s*[+-]?\d+\s*", parts[1], re.ASCII):
            return False
        if int(parts[1]) != target:
            return False
        expr = parts[0].strip()
    if not re.fullmatch(r"[0-9+\-*/()\s]+", expr, re.ASCII):  # cheap pre-filter before ast
        return False
    try:
        tree = ast.parse(expr, mode="eval")
        value = _eval(tree)
    except (SyntaxError, _Reject, RecursionError, ValueError):
        return False
    used = Counter(_literals(tree))
    given = Counter(int(x) for x in numbers)
    if use_all:
        if used != given:
            return False
    elif any(used[k] > given[k] for k in used):
        return False
    return value == target


def countdown(
    prompts,
    completions,
    target=None,
    numbers=None,
    *,
    extract: str = "auto",
    use_all: bool = True,
    **_columns,
):
    """1.0 where the completion's equation over ``numbers`` equals ``target`` (module doc)."""
    if target is None or numbers is None:
        raise ValueError("the 'countdown' reward needs 'target' and 'numbers' columns")
    if not (len(target) == len(numbers) == len(completions)):
        raise ValueError(
            f"'target' ({len(target)}), 'numbers' ({len(numbers)}) and completions "
            f"({len(completions)}) must have the same length"
        )
    if extract not in ("auto", "tag", "whole"):
        raise ValueError(
            f"extract={extract!r} is not a valid choice; expected 'auto', 'tag' or 'whole'"
        )
    scores = []
    for completion, tgt, nums in zip(completions, target, numbers):
        text = completion_text(completion)
        if extract == "tag" or (extract == "auto" and ("<answer>" in text or "</answer>" in text)):
            expr = answer_tag(text)
        else:
            expr = text
        ok = expr is not None and check_equation(expr, int(tgt), nums, use_all=use_all)
        scores.append(1.0 if ok else 0.0)
    return scores


countdown.required_columns = ("target", "numbers")  # checked before the model loads
