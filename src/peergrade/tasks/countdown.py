"""The built-in ``countdown`` task: reach a target with given numbers and + - * /.

Each row is ``{"prompt": [{"role": "user", "content": ...}], "target": int, "numbers":
list[int], "answer": str}`` (a chat message list, ``[system, user]`` with ``system_prompt``); ``answer``
is one solution (any equation that ``peergrade.rewards.countdown`` accepts also scores).

Generation: draw ``k`` numbers (``k`` uniform in ``[min_numbers, max_numbers]``, each uniform in
``[1, max_number]``), shuffle them, and fold them left to right with random operators
(``+``, ``-`` kept only when the result stays >= 0, ``*``, ``/`` only when it divides exactly),
so every problem has a solution using each number once. The target is the value of that
expression; problems whose target is outside ``[1, max_target]`` are redrawn.

Held-out split, disjoint by construction: a problem belongs to eval iff
``blake2b(sorted numbers, target) mod 10 == 0``; ``train_rows`` skips those problems,
``eval_rows`` keeps only them (distinct), and the two draw from different random streams.

This module does not score answers.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator

from .base import Task
from .prompts import chat_prompt

__all__ = ["CountdownTask", "DEFAULT_TEMPLATE", "is_eval_problem"]

DEFAULT_TEMPLATE = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use +, -, *, "
    "/ and parentheses, and each number exactly once. Put the equation inside "
    "<answer></answer>, for example <answer>(1 + 2) * 3</answer>."
)


def is_eval_problem(numbers, target: int) -> bool:
    """Whether the problem (numbers as a multiset, target) is held out (stable hash, ~10%)."""
    key = ",".join(str(x) for x in sorted(numbers)) + f"->{target}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 10 == 0


class CountdownTask(Task):
    """Seeded countdown problems; see the module docstring."""

    name = "countdown"
    columns = ("target", "numbers", "answer")
    default_rewards = [("countdown", 1.0)]

    def __init__(
        self,
        *,
        min_numbers: int = 3,
        max_numbers: int = 4,
        max_number: int = 25,
        max_target: int = 100,
        template: str = DEFAULT_TEMPLATE,
        system_prompt: str | None = None,
    ):
        for key, val, lo in (
            ("min_numbers", min_numbers, 2),
            ("max_numbers", max_numbers, 2),
            ("max_number", max_number, 1),
            ("max_target", max_target, 1),
        ):
            if not isinstance(val, int) or isinstance(val, bool) or val < lo:
                raise ValueError(f"countdown: {key} must be an integer >= {lo}, got {val!r}")
        if max_numbers < min_numbers:
            raise ValueError(
                f"countdown: max_numbers ({max_numbers}) must be >= min_numbers ({min_numbers})"
            )
        try:
            template.format(numbers=[1, 2], target=3)
        except (KeyError, IndexError, ValueError, AttributeError) as exc:
            raise ValueError(
                f"countdown: template {template!r} is not a format string over {{numbers}} and "
                f"{{target}} ({type(exc).__name__}: {exc})"
            ) from None
        self.min_numbers, self.max_numbers = min_numbers, max_numbers
        self.max_number, self.max_target = max_number, max_target
        self.template = template
        self.system_prompt = system_prompt

    def _draw(self, rng: random.Random) -> tuple[list[int], int, str]:
        while True:
            k = rng.randint(self.min_numbers, self.max_numbers)
            nums = [rng.randint(1, self.max_number) for _ in range(k)]
            order = nums[:]
            rng.shuffle(order)
            value, expr = order[0], str(order[0])
            for x in order[1:]:
                choices = ["+", "*"] + (["-"] if value - x >= 0 else [])
                choices += ["/"] if value % x == 0 else []
                op = rng.choice(choices)
                if op == "+":
                    value += x
                elif op == "-":
                    value -= x
                elif op == "*":
                    value *= x
                else:
                    value //= x  # exact: only chosen when x divides value
                expr = f"({expr} {op} {x})"
            if expr.startswith("("):
                expr = expr[1:-1]
            if 1 <= value <= self.max_target:
                return nums, value, expr

    def make_row(self, numbers: list[int], target: int, solution: str) -> dict:
        prompt = chat_prompt(
            self.template.format(numbers=numbers, target=target), self.system_prompt
        )
        return {"prompt": prompt, "target": target, "numbers": list(numbers), "answer": solution}

    def train_rows(self, seed: int = 0) -> Iterator[dict]:
        rng = random.Random(f"countdown/train/{seed}")
        while True:
            nums, target, expr = self._draw(rng)
            if not is_eval_problem(nums, target):
                yield self.make_row(nums, target, expr)

    def eval_rows(self, n: int, seed: int = 0) -> list[dict]:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"countdown: eval_rows n must be an integer >= 0, got {n!r}")
        rng = random.Random(f"countdown/eval/{seed}")
        seen, rows = set(), []
        budget = 1000 * n + 10_000
        while len(rows) < n and budget > 0:
            budget -= 1
            nums, target, expr = self._draw(rng)
            key = (tuple(sorted(nums)), target)
            if key in seen or not is_eval_problem(nums, target):
                continue
            seen.add(key)
            rows.append(self.make_row(nums, target, expr))
        if len(rows) < n:
            raise ValueError(
                f"countdown: asked for {n} held-out problems but only found {len(rows)}; "
                "ask for fewer or widen max_number / max_target"
            )
        return rows
