"""open-r1's reward family as built-ins, to its definitions, so an open-r1 recipe's
``reward_funcs`` run here unchanged (``peergrade train --trl-config``; ``peergrade.api`` maps
the names). Each reads the reference from the ``solution`` column, as open-r1's datasets name
it, and the completion's text (a message list's content, or the text itself).

- ``openr1_accuracy``: math-verify on the first LaTeX answer of the completion (a ``\\boxed{}``
  tried first; no answer outside ``$...$`` / ``\\[...\\]`` / a box), compared with the parsed
  solution: 1.0 or 0.0; ``None`` (skipped) when the solution cannot be parsed or the
  comparison raises.
- ``openr1_format``: 1.0 when the completion matches ``^<think>\\n.*?\\n</think>\\n<answer>\\n
  .*?\\n</answer>$`` (dot matches newlines, ``^``/``$`` at line ends, as open-r1's regex
  flags make it), else 0.0. peergrade's own ``format`` reward is stricter (no empty blocks).
- ``openr1_tag_count``: 0.25 for each of ``<think>\\n``, ``\\n</think>\\n``, ``\\n<answer>\\n``,
  ``\\n</answer>`` occurring exactly once.
- ``openr1_reasoning_steps``: ``min(1, k / 3)`` for k step markers ("Step 1:", a numbered
  line start, "\\n-", "\\n*", "First,", "Second,", "Next,", "Finally,").
- ``openr1_length``: Kimi 1.5's length reward over the batch: with lengths L (characters),
  ``lam = 0.5 - (L - min L) / (max L - min L)``; ``lam`` for a correct completion,
  ``min(0, lam)`` for a wrong one; all 0 when every length is equal. A solution that cannot
  be parsed counts as correct.
- ``openr1_cosine``: ``lo + 0.5 (hi - lo) (1 + cos(pi L / max_len))`` with (lo, hi) =
  (min_value_correct, max_value_correct) for a correct answer and (max_value_wrong,
  min_value_wrong) for a wrong one; 1.0 when the solution cannot be parsed.

open-r1's ``repetition_penalty`` and ``soft_overlong_punishment`` are peergrade's
``repetition_penalty`` (``lowercase=True``) and ``overlong_penalty``; its code-execution
rewards have no counterpart here (``code_tests`` is peergrade's own).

This module does not extract answers any other way than open-r1 does; ``math_accuracy`` is
peergrade's more guarded verifier.
"""

from __future__ import annotations

import math
import re

from .extract import completion_text

__all__ = [
    "openr1_accuracy",
    "openr1_cosine",
    "openr1_format",
    "openr1_length",
    "openr1_reasoning_steps",
    "openr1_tag_count",
]

_FORMAT = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL | re.M)
_STEPS = re.compile(r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)")
_TAGS = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")


def _texts(completions) -> list[str]:
    return [completion_text(c) for c in completions]


def _need_solution(solution, completions, name: str):
    if solution is None:
        raise ValueError(f"the {name!r} reward needs a 'solution' column (reference answers)")
    if len(solution) != len(completions):
        raise ValueError(
            f"'solution' has {len(solution)} entries but there are {len(completions)} completions"
        )


def _correct(text: str, sol) -> bool | None:
    """Whether ``text``'s first LaTeX answer equals ``sol``; None when ``sol`` does not parse."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig

    from .math import _math_verify

    mv = _math_verify()  # math-verify with its "timeout disabled" log lines filtered
    if not mv:
        raise ImportError("the open-r1 rewards need math-verify: pip install math-verify")
    parse, verify = mv
    gold = parse(str(sol), extraction_mode="first_match", parsing_timeout=None)
    if not gold:
        return None
    norm = NormalizationConfig(
        nits=False,
        malformed_operators=False,
        basic_latex=True,
        equations=True,
        boxed="all",
        units=True,
    )
    answer = parse(
        text,
        extraction_config=[
            LatexExtractionConfig(
                normalization_config=norm, boxed_match_priority=0, try_extract_without_anchor=False
            )
        ],
        extraction_mode="first_match",
        parsing_timeout=None,
    )
    return bool(verify(gold, answer, timeout_seconds=None))


def openr1_accuracy(prompts, completions, solution=None, **_columns):
    """1.0 / 0.0 by math-verify; None where the solution does not parse or the check raises."""
    _need_solution(solution, completions, "openr1_accuracy")
    out: list[float | None] = []
    for text, sol in zip(_texts(completions), solution):
        try:
            ok = _correct(text, sol)
        except Exception:  # math-verify on odd input: skip the sample, as open-r1 does
            ok = None
        out.append(None if ok is None else float(ok))
    return out


def openr1_format(prompts, completions, **_columns):
    """1.0 where the completion matches open-r1's think/answer pattern."""
    return [1.0 if _FORMAT.match(t) else 0.0 for t in _texts(completions)]


def openr1_tag_count(prompts, completions, **_columns):
    """0.25 per tag (with its newlines) that occurs exactly once."""
    return [sum(0.25 for tag in _TAGS if t.count(tag) == 1) for t in _texts(completions)]


def openr1_reasoning_steps(prompts, completions, **_columns):
    """min(1, step markers / 3)."""
    return [min(1.0, len(_STEPS.findall(t)) / 3) for t in _texts(completions)]


def openr1_length(prompts, completions, solution=None, **_columns):
    """Kimi 1.5's batch-relative length reward (see module docstring)."""
    _need_solution(solution, completions, "openr1_length")
    texts = _texts(completions)
    correct = [_correct(t, s) is not False for t, s in zip(texts, solution)]
    lengths = [len(t) for t in texts]
    lo, hi = min(lengths), max(lengths)
    if lo == hi:
        return [0.0] * len(texts)
    out = []
    for n, ok in zip(lengths, correct):
        lam = 0.5 - (n - lo) / (hi - lo)
        out.append(float(lam if ok else min(0.0, lam)))
    return out


def openr1_cosine(
    prompts,
    completions,
    solution=None,
    *,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
    max_len: int = 1000,
    **_columns,
):
    """Cosine-scaled by length: short correct answers score most, short wrong ones least."""
    _need_solution(solution, completions, "openr1_cosine")
    out = []
    for text, sol in zip(_texts(completions), solution):
        ok = _correct(text, sol)
        if ok is None:
            out.append(1.0)
            continue
        lo, hi = (
            (min_value_correct, max_value_correct) if ok else (max_value_wrong, min_value_wrong)
        )
        cosine = math.cos(len(text) / max_len * math.pi)
        out.append(float(lo + 0.5 * (hi - lo) * (1.0 + cosine)))
    return out
