"""Shaping penalties: ``length_penalty``, ``overlong_penalty`` (DAPO), ``repetition_penalty``.

All three return scores <= 0 and are meant to be added to an accuracy reward with a weight.
Lengths are in tokens, read from the ``completion_ids`` column the trainer passes (TRL does the
same); ``length_penalty`` falls back to characters when ``completion_ids`` is absent.

``length_penalty(..., max_length, scale=1.0)``
    ``-scale * min(L, max_length) / max_length``: linear in the length L, from 0 (empty) to
    ``-scale`` at ``max_length`` and beyond.

``overlong_penalty(..., max_length, cache_length)``  (DAPO's soft overlong punishment,
Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", eq. 13)
    With L_max = ``max_length`` and L_cache = ``cache_length``::

        R(L) = 0                               if L <= L_max - L_cache
             = ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max
             = -1                              if L > L_max

``repetition_penalty(..., n=3, unit="words", scale=1.0, lowercase=False)``
    ``-scale * (1 - distinct n-grams / total n-grams)``: 0 for text without a repeated n-gram,
    approaching ``-scale`` for a loop. Units: whitespace-separated ``"words"``, ``"chars"``, or
    ``"tokens"`` (from ``completion_ids``). Fewer than n units: 0. ``lowercase=True`` compares
    words case-blind (open-r1's ``repetition_penalty``: ``scale = -max_penalty``).

This module does not look at answers or truncate anything.
"""

from __future__ import annotations

from .extract import completion_text

__all__ = ["length_penalty", "overlong_penalty", "repetition_penalty"]


def _check_ids(completion_ids, completions, name: str):
    if completion_ids is None:
        raise ValueError(
            f"the {name!r} reward needs the 'completion_ids' column (token ids per completion)"
        )
    if len(completion_ids) != len(completions):
        raise ValueError(
            f"'completion_ids' has {len(completion_ids)} entries, expected {len(completions)}"
        )


def length_penalty(
    prompts, completions, completion_ids=None, *, max_length: int | None = None, scale=1.0, **_
):
    """``-scale * min(L, max_length) / max_length`` per completion (L in tokens, else chars)."""
    if max_length is None or max_length <= 0:
        raise ValueError(f"length_penalty needs max_length > 0, got {max_length!r}")
    if completion_ids is not None:
        _check_ids(completion_ids, completions, "length_penalty")
        lengths = [len(ids) for ids in completion_ids]
    else:
        lengths = [len(completion_text(c)) for c in completions]
    return [-float(scale) * min(n, max_length) / max_length for n in lengths]


def overlong_penalty(
    prompts,
    completions,
    completion_ids=None,
    *,
    max_length: int | None = None,
    cache_length: int | None = None,
    **_,
):
    """DAPO soft overlong punishment per completion (see module docstring), in [-1, 0]."""
    if max_length is None or cache_length is None:
        raise ValueError(
            "overlong_penalty needs max_length (L_max) and cache_length (L_cache), e.g. "
            "kwargs {max_length: 512, cache_length: 128}"
        )
    if not 0 < cache_length <= max_length:
        raise ValueError(
            f"overlong_penalty needs 0 < cache_length <= max_length, got cache_length="
            f"{cache_length}, max_length={max_length}"
        )
    _check_ids(completion_ids, completions, "overlong_penalty")
    start = max_length - cache_length
    out = []
    for ids in completion_ids:
        n = len(ids)
        if n <= start:
            out.append(0.0)
        elif n <= max_length:
            out.append((start - n) / cache_length)
        else:
            out.append(-1.0)
    return out


def _repeated_fraction(units: list, n: int) -> float:
    if len(units) < n:
        return 0.0
    grams = [tuple(units[i : i + n]) for i in range(len(units) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams)


def repetition_penalty(
    prompts,
    completions,
    completion_ids=None,
    *,
    n: int = 3,
    unit: str = "words",
    scale=1.0,
    lowercase: bool = False,
    **_,
):
    """``-scale * (1 - distinct n-grams / n-grams)`` per completion (see module docstring)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"repetition_penalty needs an integer n >= 1, got {n!r}")
    texts = [completion_text(c) for c in completions]
    if lowercase:
        texts = [t.lower() for t in texts]
    if unit == "words":
        seqs = [t.split() for t in texts]
    elif unit == "chars":
        seqs = [list(t) for t in texts]
    elif unit == "tokens":
        _check_ids(completion_ids, completions, "repetition_penalty")
        seqs = [list(ids) for ids in completion_ids]
    else:
        raise ValueError(
            f"unit={unit!r} is not a valid choice; expected 'words', 'chars' or 'tokens'"
        )
    return [-float(scale) * _repeated_fraction(s, n) for s in seqs]
