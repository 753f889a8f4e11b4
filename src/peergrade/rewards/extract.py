"""Answer extraction shared by the built-in rewards, with the reward-hacking guards.

A verifier is only as good as the rule that picks "the answer" out of free text. The rules here
are deliberately strict, because a policy under GRPO pressure will find any leniency:

- ``completion_text``: a completion is a string or a TRL conversational message list
  (``[{"role": "assistant", "content": ...}]``); the text is the content of the last message
  (content parts ``[{"type": "text", "text": ...}]`` are joined).
- ``answer_tag``: the content of exactly one ``<answer>...</answer>`` block. Zero blocks, two or
  more blocks (even with equal contents), an unclosed or nested tag give ``None``.
- ``boxed``: the content of ``\\boxed{...}`` (balanced braces, also ``\\fbox{}``). Several boxes
  are accepted only when they all hold the same text (a model restating its answer); several
  different boxes give ``None`` (a candidate list is not an answer).
- ``last_number``: the last number in the text. This rule is lenient by nature (it cannot tell
  "the answer is 12" from "12 or 13"); it is only used when a configuration asks for it.
- ``parse_int``: one integer and nothing else: optional sign (ASCII or Unicode minus), digits,
  (ASCII 0-9 only), optionally grouped by commas in exact groups of three ("1,234" and "-1,234,567" are integers;
  "12,34" or "1,2" are not: they read as lists). Spaces inside ("12 13") make it not an integer.

This module does not compare answers (the rewards do) and never evaluates text.
"""

from __future__ import annotations

import re

__all__ = [
    "completion_text",
    "answer_tag",
    "boxed",
    "last_number",
    "parse_int",
]

_INT_RE = re.compile(r"[+-]?(?:\d+|\d{1,3}(?:,\d{3})+)", re.ASCII)
# Numbers for the lenient last-number rule: integers (comma-grouped or not), decimals, fractions.
_NUMBER_RE = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?", re.ASCII)
_OPEN_TAG = "<answer>"
_CLOSE_TAG = "</answer>"


def completion_text(completion) -> str:
    """The text of one completion: a string, or the last message of a chat message list."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return _content_text(completion.get("content", ""))
    if isinstance(completion, (list, tuple)):
        if not completion:
            return ""
        last = completion[-1]
        if isinstance(last, dict):
            return _content_text(last.get("content", ""))
        if isinstance(last, str):
            return last
    raise TypeError(
        "a completion must be a string or a list of chat messages "
        f"([{{'role': 'assistant', 'content': ...}}]), got {type(completion).__name__}"
    )


def _content_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multimodal-style parts: keep the text ones
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text":
                parts.append(str(part.get("text", "")))
        return "".join(parts)
    return str(content)


def answer_tag(text: str) -> str | None:
    """The stripped content of the single ``<answer>...</answer>`` block, else ``None``.

    ``None`` when there is no block, more than one opening or closing tag, or the tags are out
    of order. The content may be empty (the caller decides what an empty answer is worth).
    """
    if text.count(_OPEN_TAG) != 1 or text.count(_CLOSE_TAG) != 1:
        return None
    start = text.index(_OPEN_TAG) + len(_OPEN_TAG)
    end = text.index(_CLOSE_TAG)
    if end < start:
        return None
    return text[start:end].strip()


def _boxed_contents(text: str) -> list[str] | None:
    """Contents of every ``\\boxed{...}`` / ``\\fbox{...}``; ``None`` if one is unbalanced."""
    out = []
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
            i += 1
        if depth:
            return None
        out.append(text[m.end() : i - 1].strip())
    return out


def boxed(text: str, *, allow_multiple: bool = False) -> str | None:
    """The content of ``\\boxed{...}``, or ``None`` (no box, unbalanced, or several that differ).

    With ``allow_multiple=True`` the last box wins even when boxes disagree (not the default:
    it lets a model box every candidate).
    """
    contents = _boxed_contents(text)
    if not contents:
        return None
    if allow_multiple or len(set(contents)) == 1:
        return contents[-1]
    return None


def last_number(text: str) -> str | None:
    """The last number in ``text`` (integer, decimal or a/b fraction, commas removed)."""
    text = text.replace("\u2212", "-")
    found = _NUMBER_RE.findall(text)
    if not found:
        return None
    return found[-1].replace(",", "")


def parse_int(text: str | None) -> int | None:
    """``text`` as one integer (see the module docstring for the exact rule), else ``None``."""
    if text is None:
        return None
    s = text.strip().replace("\u2212", "-")
    if not _INT_RE.fullmatch(s):
        return None
    return int(s.replace(",", ""))
