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

This module does not generate problems (``peergrade.tasks``) and never evaluates model text.
"""

from __future__ import annotations

from .extract import answer_tag, completion_text, last_number, parse_int

__all__ = ["arithmetic", "extract_integer"]


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
