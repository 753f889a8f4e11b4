"""Prompt rendering: a row's prompt (text or chat messages) -> the string the model sees.

``render_prompt(row_prompt, tokenizer, *, system_prompt=None, use_chat_template="auto")``:

- ``"auto"`` (default; TRL's rule): a chat message list goes through the tokenizer's chat
  template, a plain string is fed as it is -- unless ``system_prompt`` is given, which makes
  it a chat (a system message only exists in one);
- ``True``: every prompt goes through the template, a plain string as one user message
  ``{"role": "user", "content": text}``;
- ``False``: no template.

A chat message list is kept as is (each message must be a dict with a ``role`` and
``content``); ``system_prompt`` is prepended as a system message, unless the messages already
start with one (then the row's own system message wins: it was written for that row). The
template is applied with ``add_generation_prompt=True`` and ``tokenize=False``, so the string
ends where the assistant's answer starts.

Without a template (``tokenizer.chat_template`` is unset, ``tokenizer`` is ``None``, or the
rule above says none) the prompt is plain text: the contents of the messages joined by blank
lines (system first), with no role markers added. A base model prompted with ``"12+7="`` thus
sees exactly ``"12+7="``.

``chat_prompt(text, system_prompt)`` is the message list a built-in task gives as its prompt.

``with_examples(row_prompt, examples)`` puts solved example turns (a user message with the
example's question, an assistant message with its reply) before the row's question, after a
leading system message if the row has one: the few-shot prompt of ``data.few_shot``.

``encode_prompts(rows, tokenizer, ...)`` turns rows into the token ids the model sees, as TRL
makes them; training and evaluation both encode through it.

``chat_template_note(row_prompt, tokenizer, ...)`` is the line a run prints at start when
prompts are plain text and the tokenizer has a chat template: what the model sees with the
configured ``data.use_chat_template`` and what it would see the other way.

It takes a tokenizer as a plain argument and loads no model.
"""

from __future__ import annotations

from peergrade.errors import InputError

__all__ = [
    "chat_prompt",
    "chat_template_note",
    "encode_prompts",
    "render_prompt",
    "to_messages",
    "uses_chat_template",
    "with_examples",
]


def chat_prompt(text: str, system_prompt: str | None = None) -> list[dict]:
    """A built-in task's prompt: ``text`` as one user message, after ``system_prompt`` if given.

    Built-in tasks give chat messages, so that by the ``"auto"`` rule they go through the chat
    template (and reward functions get TRL's conversational completions)."""
    user = {"role": "user", "content": text}
    return [{"role": "system", "content": system_prompt}, user] if system_prompt else [user]


def to_messages(row_prompt, system_prompt: str | None = None) -> list[dict]:
    """The chat message list of a row prompt, with ``system_prompt`` prepended if given."""
    if isinstance(row_prompt, str):
        messages = [{"role": "user", "content": row_prompt}]
    elif isinstance(row_prompt, (list, tuple)):
        messages = []
        for j, m in enumerate(row_prompt):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(
                    f"prompt message {j} must be a dict with 'role' and 'content', got {m!r}"
                )
            messages.append(dict(m))
        if not messages:
            raise ValueError("prompt is an empty message list")
    else:
        raise ValueError(
            f"a prompt must be a string or a list of chat messages, got {type(row_prompt).__name__}"
        )
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def uses_chat_template(
    row_prompt, tokenizer, system_prompt: str | None = None, use_chat_template: bool | str = "auto"
) -> bool:
    """Whether ``render_prompt`` puts ``row_prompt`` through ``tokenizer``'s chat template.

    A prompt that does not goes to the tokenizer as plain text, special tokens added as TRL
    adds them (``tokenizer(text)``: e.g. a BOS); a templated one brings its own."""
    if use_chat_template == "auto":
        use_chat_template = not isinstance(row_prompt, str) or bool(system_prompt)
    elif not isinstance(use_chat_template, bool):
        raise ValueError(
            f"use_chat_template={use_chat_template!r} is not valid; expected 'auto', True or False"
        )
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    return bool(use_chat_template and template)


def render_prompt(
    row_prompt,
    tokenizer=None,
    *,
    system_prompt: str | None = None,
    use_chat_template: bool | str = "auto",
) -> str:
    """The text the model is given for ``row_prompt`` (see the module docstring)."""
    messages = to_messages(row_prompt, system_prompt)
    if uses_chat_template(row_prompt, tokenizer, system_prompt, use_chat_template):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not isinstance(text, str):  # defensive: some versions return a list for one conv
            text = text[0]
        return text
    return "\n\n".join(str(m["content"]) for m in messages)


def with_examples(row_prompt, examples: list[tuple[object, str]]) -> list[dict]:
    """``row_prompt`` as chat messages with ``examples`` (``(question, reply)`` pairs; a question
    is a string or a message list whose user turns are used) inserted before its first
    non-system message."""
    messages = to_messages(row_prompt)
    head = 1 if messages[0]["role"] == "system" else 0
    turns: list[dict] = []
    for question, reply in examples:
        asked = [m for m in to_messages(question) if m["role"] != "system"]
        turns += asked + [{"role": "assistant", "content": reply}]
    return messages[:head] + turns + messages[head:]


def encode_prompts(
    rows: list[dict],
    tokenizer,
    *,
    system_prompt: str | None = None,
    use_chat_template: bool | str = "auto",
    max_prompt_length: int | None = None,
) -> list[list[int]]:
    """Token ids of each row's prompt, as TRL makes them: a chat-template prompt as
    ``apply_chat_template(..., tokenize=True)`` gives them (the template writes any special
    tokens), a plain-text prompt as ``tokenizer(text)`` does (special tokens added, e.g. BOS)."""
    ids = []
    for i, row in enumerate(rows):
        text = render_prompt(
            row["prompt"],
            tokenizer,
            system_prompt=system_prompt,
            use_chat_template=use_chat_template,
        )
        templated = uses_chat_template(row["prompt"], tokenizer, system_prompt, use_chat_template)
        toks = tokenizer(text, add_special_tokens=not templated)["input_ids"]
        if max_prompt_length is not None and len(toks) > max_prompt_length:
            raise InputError(
                f"prompt of row {i} has {len(toks)} tokens, more than data.max_prompt_length="
                f"{max_prompt_length}: {text[:80]!r}..."
            )
        ids.append(toks)
    return ids


def chat_template_note(
    row_prompt, tokenizer, *, system_prompt: str | None = None, use_chat_template="auto"
) -> str | None:
    """One line for the run's start when ``row_prompt`` is plain text and ``tokenizer`` has a
    chat template: which way ``data.use_chat_template`` feeds it, and what the model would see
    the other way (a chat-trained model given raw text may never answer: every reward 0).
    ``None`` for chat-message prompts or a tokenizer without a template: nothing to choose."""
    if not isinstance(row_prompt, str) or not getattr(tokenizer, "chat_template", None):
        return None

    def shown(flag: bool) -> str:
        text = render_prompt(
            row_prompt, tokenizer, system_prompt=system_prompt, use_chat_template=flag
        )
        return repr(text if len(text) <= 90 else text[:87] + "...")

    templated = uses_chat_template(row_prompt, tokenizer, system_prompt, use_chat_template)
    setting = str(use_chat_template).lower()
    if templated:
        return (
            f"prompts are plain text; data.use_chat_template={setting} puts them through the "
            f"tokenizer's chat template: the model sees {shown(True)} "
            f"(with --data.use_chat_template false it would see {shown(False)})"
        )
    return (
        f"prompts are plain text and the tokenizer has a chat template; "
        f"data.use_chat_template={setting} feeds them as they are: the model sees {shown(False)} "
        f"(a chat-trained model may need --data.use_chat_template true: {shown(True)})"
    )
