"""The ``format`` reward: R1-style ``<think>...</think><answer>...</answer>`` structure, or
just a final ``<answer>...</answer>`` block (``mode="answer_only"``, for instruct models).

``format_reward(prompts, completions, *, mode="strict", think_in_prompt=False)`` scores 1.0
for a well-formed completion and 0.0 otherwise. It says nothing about correctness; pair it
with an accuracy reward at a small weight.

- ``mode="strict"``: the whole completion (leading/trailing whitespace ignored) is exactly
  ``<think>T</think>`` then optional whitespace then ``<answer>A</answer>``, nothing else.
- ``mode="lenient"``: text may surround the blocks, but the completion holds exactly one
  ``<think>`` block followed (later) by exactly one ``<answer>`` block.
- ``mode="answer_only"``: for prompts that ask an instruct model (which will not write
  ``<think>``) to "put the final answer inside <answer></answer>". The completion holds exactly
  one ``<answer>`` and one ``</answer>`` tag, in that order, with non-whitespace content, and
  nothing but whitespace after ``</answer>`` (the answer is the final thing written). Any text
  may come before it; think tags are neither required nor checked.

In both modes each tag occurs exactly once, the four tags are in the order think-open,
think-close, answer-open, answer-close (so blocks cannot nest or overlap), and ``T`` and ``A``
contain something other than whitespace: empty tags (``<think></think><answer></answer>``)
earn nothing, which is the guard against farming the format reward without reasoning or an
answer. ``think_in_prompt=True`` is for prompts that already end with ``<think>``: the
completion then starts inside the think block and must not open it again.

This module does not check what the answer says.
"""

from __future__ import annotations

from .extract import completion_text

__all__ = ["format_reward", "is_well_formed"]

_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def is_well_formed(text: str, mode: str = "strict") -> bool:
    """Whether ``text`` has the R1 structure under ``mode`` (see module docstring)."""
    if mode == "answer_only":
        if text.count("<answer>") != 1 or text.count("</answer>") != 1:
            return False
        a0, a1 = text.index("<answer>"), text.index("</answer>")
        if a1 < a0 or not text[a0 + len("<answer>") : a1].strip():
            return False
        return not text[a1 + len("</answer>") :].strip()
    if mode not in ("strict", "lenient"):
        raise ValueError(
            f"mode={mode!r} is not a valid choice; expected 'answer_only', 'strict' or 'lenient'"
        )
    if any(text.count(tag) != 1 for tag in _TAGS):
        return False
    t0, t1, a0, a1 = (text.index(tag) for tag in _TAGS)
    if not (t0 < t1 < a0 < a1):
        return False
    think = text[t0 + len("<think>") : t1]
    answer = text[a0 + len("<answer>") : a1]
    if not think.strip() or not answer.strip():
        return False
    if mode == "strict":
        before = text[:t0]
        between = text[t1 + len("</think>") : a0]
        after = text[a1 + len("</answer>") :]
        return not before.strip() and not between.strip() and not after.strip()
    return True


def format_reward(
    prompts, completions, *, mode: str = "strict", think_in_prompt: bool = False, **_columns
):
    """1.0 for each completion with the structure ``mode`` asks for, else 0.0."""
    if mode not in ("strict", "lenient", "answer_only"):
        raise ValueError(
            f"mode={mode!r} is not a valid choice; expected 'answer_only', 'strict' or 'lenient'"
        )
    scores = []
    for completion in completions:
        text = completion_text(completion)
        if think_in_prompt:
            if "<think>" in text:  # the prompt opened the block; opening it again is malformed
                scores.append(0.0)
                continue
            text = "<think>" + text
        scores.append(1.0 if is_well_formed(text, mode) else 0.0)
    return scores
