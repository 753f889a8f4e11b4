"""Chat-template token deltas: how the environment's messages become tokens after a model turn.

The model's turns are never decoded and re-encoded. What the environment says is appended as the
token difference of two renderings of the whole conversation by the model's chat template:

    before = render(history + [assistant turn])                       cut after its last end-of-turn token
    after  = render(history + [assistant turn] + new messages, with the generation prompt)
    delta  = after[len(before):]                                       (checked: after starts with before)

so the delta holds exactly what the template puts between the end-of-turn token the model
sampled and the next assistant header: the newline after ``<|im_end|>``, the tool/user turns, the
generation prompt. Rendering the whole conversation (not only the new messages) keeps a default
system prompt from being rendered twice; the tokens of the model's turn in ``before`` are
discarded, so how the template re-tokenises that text never matters.

Only the delta is tokenised: both renderings are compared as text, and the text after the
cut is encoded behind the end-of-turn token's own text (a special token is a hard split for a
tokenizer, so the tokens after it are the same as in the whole rendering, including the
tokenizer's rules for the start of a piece). Encoding the whole conversation twice a turn
grows with the history (about 21 ms a rendering of 12k tokens with SmolLM2's tokenizer,
against 0.6 ms for its text); the token comparison above is the fallback wherever the texts
do not line up that way.

``check_template`` verifies at start-up, on a small probe conversation, that the template is
prefix-preserving for assistant, tool and user turns (the rendering of earlier turns does not
change when a message is added), that an assistant turn ends with an end-of-turn (eos) token, and
that tool messages are rendered at all.

This module does not sample, parse tool calls or choose a replacement template for families
whose template is not prefix-preserving (TRL's ``get_training_chat_template`` knows a few); it
stops with an error that says so.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from peergrade.errors import InputError


class TemplateError(InputError):
    """The chat template cannot render episodes token-exactly (names the template and the fix)."""


FIX = (
    "pass a chat template (chat_template=...) that renders earlier turns identically whatever "
    "follows and ends every assistant turn with the eos token, e.g. the family's training "
    "template (TRL: trl.chat_template_utils.get_training_chat_template)"
)


def template_name(tokenizer) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def render(
    tokenizer,
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool,
    tools: list[dict] | None = None,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """Token ids of ``messages`` rendered by the chat template (``tools or None``: some
    templates render tool boilerplate for an empty list)."""
    ids = tokenizer.apply_chat_template(
        list(messages),
        tools=tools or None,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=False,
        chat_template=chat_template,
        **(template_kwargs or {}),
    )
    if ids and isinstance(ids[0], list):  # some processors return a batch of one
        ids = ids[0]
    return [int(t) for t in ids]


def _render_text(
    tokenizer,
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool,
    tools=None,
    chat_template=None,
    template_kwargs=None,
):
    """``render``'s text, untokenised (None: the tokenizer renders something else)."""
    text = tokenizer.apply_chat_template(
        list(messages),
        tools=tools or None,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        chat_template=chat_template,
        **(template_kwargs or {}),
    )
    return text if isinstance(text, str) else None


#: ``_eos_texts``'s answers, per tokenizer (a turn's delta asks again every turn)
_EOS_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _eos_texts(tokenizer, eos_ids: Sequence[int]) -> dict[str, int]:
    """Text -> id of each eos token that the tokenizer encodes back into that one token (a
    special token, matched before anything else), so that text is a hard split."""
    key = tuple(int(i) for i in eos_ids)
    try:
        known = _EOS_TEXTS.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced: asked every time
        known = {}
    if key not in known:
        known[key] = _find_eos_texts(tokenizer, key)
    return known[key]


def _find_eos_texts(tokenizer, eos_ids: tuple[int, ...]) -> dict[str, int]:
    out = {}
    for i in eos_ids:
        text = tokenizer.convert_ids_to_tokens(int(i))
        if isinstance(text, str) and text and _encode(tokenizer, text) == [int(i)]:
            out[text] = int(i)
    return out


def _encode(tokenizer, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [int(t) for t in ids]


def _delta_by_text(tokenizer, history, new_messages, eos_ids, kw, close_turn) -> list[int] | None:
    """``turn_delta`` encoding only the delta (module doc), or None where that does not apply:
    the renderings are not text, no eos token's text ends the assistant turn, or the later
    rendering does not start with the earlier one's text up to it (the token path decides).
    A processor (no ``convert_ids_to_tokens``) takes the token path too."""
    if not hasattr(tokenizer, "convert_ids_to_tokens"):
        return None
    before = _render_text(tokenizer, history, add_generation_prompt=False, **kw)
    if before is None:
        return None
    eos = _eos_texts(tokenizer, eos_ids)
    found = [(before.rfind(t) + len(t), t) for t in eos if t in before]
    if not found:
        return None
    cut, text = max(found)
    after = _render_text(
        tokenizer, list(history) + list(new_messages), add_generation_prompt=True, **kw
    )
    if after is None or not after.startswith(before[:cut]):
        return None
    ids = _encode(tokenizer, text + after[cut:])  # the delta behind its end-of-turn token
    if not ids or ids[0] != eos[text]:
        return None
    return ids if close_turn else ids[1:]


def _cut_after_last(ids: list[int], eos_ids: set[int]) -> list[int] | None:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] in eos_ids:
            return ids[: i + 1]
    return None


def turn_delta(
    tokenizer,
    history: Sequence[dict],
    new_messages: Sequence[dict],
    *,
    eos_ids: Sequence[int],
    tools: list[dict] | None = None,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
    close_turn: bool = False,
) -> list[int]:
    """The tokens to append after a model turn that ended with an eos token: ``new_messages``
    (may be empty) and the next generation prompt. ``history`` ends with that assistant turn.
    ``close_turn``: the turn ended without its end-of-turn token (at a stop string), so the
    delta starts with the template's own end-of-turn token."""
    kw = dict(tools=tools, chat_template=chat_template, template_kwargs=template_kwargs)
    delta = _delta_by_text(tokenizer, history, new_messages, eos_ids, kw, close_turn)
    if delta is None:
        delta = delta_by_tokens(tokenizer, history, new_messages, eos_ids, kw, close_turn)
    if len(delta) <= close_turn:
        raise TemplateError(
            f"chat template of {template_name(tokenizer)} rendered nothing after an assistant "
            "turn (no generation prompt?)"
        )
    return delta


def delta_by_tokens(tokenizer, history, new_messages, eos_ids, kw, close_turn) -> list[int]:
    """``turn_delta`` from the two whole renderings in tokens (the fallback; the text path's
    reference in ``bench/template_delta.py``)."""
    before = _cut_after_last(
        render(tokenizer, history, add_generation_prompt=False, **kw), set(eos_ids)
    )
    after = render(tokenizer, list(history) + list(new_messages), add_generation_prompt=True, **kw)
    if before is None or after[: len(before)] != before:
        roles = ", ".join(m.get("role", "?") for m in new_messages) or "(none)"
        raise TemplateError(
            f"chat template of {template_name(tokenizer)} is not prefix-preserving: adding messages "
            f"with roles {roles} "
            f"changed the tokens of the conversation before them; {FIX}"
        )
    return after[len(before) - 1 :] if close_turn else after[len(before) :]


_PROBE_CALL = {"type": "function", "function": {"name": "probe_tool", "arguments": {"x": 1}}}
_PROBE_RESULT = "probe result 4217"


def check_template(
    tokenizer,
    *,
    eos_ids: Sequence[int],
    roles: Sequence[str] = ("tool", "user"),
    tools: list[dict] | None = None,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
) -> None:
    """Raise a TemplateError naming the template and the fix unless episodes can be rendered
    token-exactly: the generation prompt is a prefix of the rendered assistant turn, that turn
    ends with an eos token, and adding a turn of each role in ``roles`` after it keeps every
    earlier token (and a tool turn shows the tool's result)."""
    name = template_name(tokenizer)
    kw = dict(tools=tools, chat_template=chat_template, template_kwargs=template_kwargs)
    eos = set(int(t) for t in eos_ids)
    user = [{"role": "user", "content": "probe question"}]
    # With a reasoning block: templates that drop earlier turns' reasoning (Qwen3's) fail here.
    reply = {"role": "assistant", "content": "<think>\nprobe thought\n</think>\n\nprobe answer"}
    try:
        prompt = render(tokenizer, user, add_generation_prompt=True, **kw)
        full = render(tokenizer, user + [reply], add_generation_prompt=False, **kw)
    except Exception as e:  # a template that fails on plain chat is unusable here
        raise TemplateError(f"chat template of {name} failed to render a chat: {e}") from e
    if full[: len(prompt)] != prompt:
        raise TemplateError(
            f"chat template of {name}: its generation prompt is not how it renders the start of "
            f"an assistant turn, so sampled turns would not match the template; {FIX}"
        )
    if not any(t in eos for t in full[len(prompt) :]):
        raise TemplateError(
            f"chat template of {name}: an assistant turn does not end with an eos token "
            f"(ids {sorted(eos)}), so a model turn cannot end where the template ends it; {FIX}"
        )
    for role in roles:
        if role == "tool":
            turn = dict(reply, content="", tool_calls=[_PROBE_CALL])
            new = [{"role": "tool", "name": "probe_tool", "content": _PROBE_RESULT}]
        else:
            turn, new = reply, [{"role": role, "content": _PROBE_RESULT}]
        try:
            delta = turn_delta(tokenizer, user + [turn], new, eos_ids=eos_ids, **kw)
        except TemplateError as e:
            raise TemplateError(f"{e} (start-up check, {role} turn)") from e
        except Exception as e:
            raise TemplateError(
                f"chat template of {name} cannot render a {role} message after an assistant "
                f"turn: {e}; {FIX}"
            ) from e
        if _PROBE_RESULT not in tokenizer.decode(delta):
            raise TemplateError(
                f"chat template of {name} drops the content of {role} messages (a tool or "
                f"environment answer would never reach the model); {FIX}"
            )


def renders_tools(tokenizer, tools: list[dict], **kw) -> bool:
    """Whether the chat template shows ``tools`` to the model: a probe conversation rendered
    with and without them differs."""
    user = [{"role": "user", "content": "probe question"}]
    with_tools = render(tokenizer, user, add_generation_prompt=True, tools=tools, **kw)
    return with_tools != render(tokenizer, user, add_generation_prompt=True, **kw)


def tool_names(tools: list[dict] | None) -> str:
    """The tools' function names, comma-separated (for messages about them)."""
    return ", ".join(str(t.get("function", t).get("name", "?")) for t in tools or [])


def check_tools_rendered(tokenizer, tools: list[dict], **kw) -> None:
    """A TemplateError naming the template, the tools and the ways out unless the template
    renders tool schemas (a template that drops them trains with tools the model never sees,
    so it makes no calls and nothing says why)."""
    if not tools or renders_tools(tokenizer, tools, **kw):
        return
    names = tool_names(tools)
    raise TemplateError(
        f"chat template of {template_name(tokenizer)} does not render tool schemas: the "
        f"model would never see the tools ({names}) and would train making no calls. Use a "
        "tokenizer whose chat template renders `tools` (e.g. Qwen2.5's; from Python: "
        "processing_class=tokenizer with tokenizer.chat_template set), or, when the model "
        "already knows the tools (a warm-up: docs/environments.md), describe them in "
        "data.system_prompt and set env.unrendered_tools: true (GRPOConfig(peergrade="
        "{'env.unrendered_tools': True}))"
    )
