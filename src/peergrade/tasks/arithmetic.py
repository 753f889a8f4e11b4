"""The built-in ``arithmetic`` task: seeded multi-digit ``+``, ``-``, ``*`` problems.

Each row is ``{"prompt": [{"role": "user", "content": "12+7="}], "answer": str, "a": int,
"b": int, "op": str}`` (the prompt is a chat message list, see ``prompts.chat_prompt``) where ``answer``
is the exact integer result as text (``"-12"``, ``"1036"``) and ``op`` is ``"+"``, ``"-"`` or
``"*"``. The verifier is the built-in reward ``arithmetic`` (``peergrade.rewards.math``).

Difficulty (defaults: two-digit ``+`` and ``-``, the CPU demo's task; ``ops="+-*"`` and
``max_digits=3`` make it harder): each operand independently gets a digit count drawn uniformly from
``[min_digits, max_digits]``, then a value drawn uniformly among numbers with that many digits
(one digit means 0-9, so 0 occurs; d >= 2 digits means 10^(d-1) .. 10^d - 1). The operator is
drawn uniformly from ``ops``. Subtraction: by default the operands are ordered so that
``a >= b`` and results are never negative (a small model learns one thing at a time);
``allow_negative=True`` keeps the drawn order, so answers like ``"-12"`` occur.

Prompts: ``template`` is a Python format string over ``{a}``, ``{op}``, ``{b}``. The default
``"{a}{op}{b}="`` suits a base / character-level model that answers with the bare number;
``INSTRUCT_TEMPLATE`` suits an instruct model and asks for ``<answer></answer>`` tags (the
reward's ``extract="auto"`` grades both forms). With ``system_prompt`` the message list is
``[system, user]``.

Held-out split, disjoint by construction: a problem ``(a, op, b)`` belongs to the eval split
iff ``blake2b(f"{a}{op}{b}") mod 10 == 0`` (about 10% of all problems; stable across Python
versions and machines, unlike ``hash()``); ``train_rows`` skips those problems and ``eval_rows``
only keeps them. Train and eval also draw from different random streams (string seeds
``"arithmetic/train/<seed>"`` vs ``"arithmetic/eval/<seed>"``). ``eval_rows`` returns distinct
problems and raises when the difficulty setting has fewer than ``n`` held-out problems.

This module does not score answers and does not apply chat templates.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator

from .base import Task
from .prompts import chat_prompt

__all__ = ["ArithmeticTask", "DEFAULT_TEMPLATE", "INSTRUCT_TEMPLATE", "is_eval_problem", "solve"]

DEFAULT_TEMPLATE = "{a}{op}{b}="
INSTRUCT_TEMPLATE = "What is {a} {op} {b}? Put the final number inside <answer></answer>."
VALID_OPS = "+-*"
EVAL_MODULUS = 10  # one problem in EVAL_MODULUS (by hash) is held out


def solve(a: int, op: str, b: int) -> int:
    """The exact result of ``a op b``."""
    if op == "+":
        return a + b
    elif op == "-":
        return a - b
    elif op == "*":
        return a * b
    else:
        raise ValueError(f"op={op!r} is not a valid operator; expected one of '+', '-', '*'")


def is_eval_problem(a: int, op: str, b: int) -> bool:
    """Whether the problem ``(a, op, b)`` belongs to the held-out split (stable hash, ~10%)."""
    digest = hashlib.blake2b(f"{a}{op}{b}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % EVAL_MODULUS == 0


class ArithmeticTask(Task):
    """Seeded ``a op b`` problems; see the module docstring for the distribution and splits."""

    name = "arithmetic"
    columns = ("answer", "a", "b", "op")
    default_rewards = [("arithmetic", 1.0)]

    def __init__(
        self,
        *,
        min_digits: int = 2,
        max_digits: int = 2,
        ops: str = "+-",
        template: str = DEFAULT_TEMPLATE,
        allow_negative: bool = False,
        system_prompt: str | None = None,
    ):
        for key, val in (("min_digits", min_digits), ("max_digits", max_digits)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"arithmetic: {key} must be an integer >= 1, got {val!r}")
        if max_digits < min_digits:
            raise ValueError(
                f"arithmetic: max_digits ({max_digits}) must be >= min_digits ({min_digits})"
            )
        if max_digits > 18:
            raise ValueError(f"arithmetic: max_digits must be <= 18, got {max_digits}")
        if not isinstance(ops, str) or not ops or any(c not in VALID_OPS for c in ops):
            raise ValueError(
                f"arithmetic: ops must be a non-empty string of the characters '+', '-', '*' "
                f"(e.g. '+-*'), got {ops!r}"
            )
        if not isinstance(template, str):
            raise ValueError(f"arithmetic: template must be a string, got {template!r}")
        try:
            template.format(a=12, op="+", b=3)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"arithmetic: template {template!r} is not a format string over the fields "
                f"{{a}}, {{op}}, {{b}} ({type(exc).__name__}: {exc})"
            ) from None
        self.min_digits = min_digits
        self.max_digits = max_digits
        self.ops = "".join(dict.fromkeys(ops))  # dedupe, keep order
        self.template = template
        self.allow_negative = bool(allow_negative)
        self.system_prompt = system_prompt

    # -- generation ------------------------------------------------------------------------
    def _operand(self, rng: random.Random) -> int:
        d = rng.randint(self.min_digits, self.max_digits)
        lo = 0 if d == 1 else 10 ** (d - 1)
        return rng.randint(lo, 10**d - 1)

    def _draw(self, rng: random.Random) -> tuple[int, str, int]:
        a, b = self._operand(rng), self._operand(rng)
        op = rng.choice(self.ops)
        if op == "-" and not self.allow_negative and a < b:
            a, b = b, a
        return a, op, b

    def make_row(self, a: int, op: str, b: int) -> dict:
        """The row of one problem (no split check: use for hand-made examples)."""
        return {
            "prompt": chat_prompt(self.template.format(a=a, op=op, b=b), self.system_prompt),
            "answer": str(solve(a, op, b)),
            "a": a,
            "b": b,
            "op": op,
        }

    def train_rows(self, seed: int = 0) -> Iterator[dict]:
        """Endless training problems (held-out problems skipped); duplicates may occur."""
        rng = random.Random(f"arithmetic/train/{seed}")
        misses = 0
        while True:
            a, op, b = self._draw(rng)
            if is_eval_problem(a, op, b):
                misses += 1
                if misses > 10_000:  # only possible if the problem space is all held out
                    raise RuntimeError("arithmetic: no training problems at this difficulty")
                continue
            misses = 0
            yield self.make_row(a, op, b)

    def eval_rows(self, n: int, seed: int = 0) -> list[dict]:
        """``n`` distinct held-out problems (raises if fewer exist at this difficulty)."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"arithmetic: eval_rows n must be an integer >= 0, got {n!r}")
        rng = random.Random(f"arithmetic/eval/{seed}")
        seen: set[tuple[int, str, int]] = set()
        rows = []
        budget = 1000 * n + 10_000
        while len(rows) < n and budget > 0:
            budget -= 1
            prob = self._draw(rng)
            if prob in seen or not is_eval_problem(*prob):
                continue
            seen.add(prob)
            rows.append(self.make_row(*prob))
        if len(rows) < n:
            raise ValueError(
                f"arithmetic: asked for {n} held-out problems but only found {len(rows)} with "
                f"min_digits={self.min_digits}, max_digits={self.max_digits}, ops={self.ops!r}; "
                "ask for fewer or raise max_digits"
            )
        return rows
