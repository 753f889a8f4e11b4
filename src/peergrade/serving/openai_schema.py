"""What the endpoint accepts: requests checked against the OpenAI API (and vLLM's extras), and
errors in OpenAI's shape.

``APIError`` is a refused request (``{"error": {"message", "type", "param", "code"}}``, HTTP 400
unless said otherwise). ``normalise_messages`` / ``check_tools`` check a chat request's
messages and tools; ``parse_settings`` its sampling fields (``Settings``);
``refuse_unsupported`` refuses what the server cannot honour instead of ignoring it;
``parse_prompts`` a completion's prompt(s); ``parse_generate`` checks vLLM's token-in
``/inference/v1/generate`` request
(``TokenRequest``: prompt token ids, sampling settings, extra stop token ids).

It does not sample, render chat templates or build replies (``server``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from peergrade.generation.record import SamplerSettings

__all__ = [
    "APIError",
    "Settings",
    "TokenRequest",
    "canonical",
    "check_tools",
    "offered_tools",
    "normalise_messages",
    "parse_generate",
    "parse_prompts",
    "parse_settings",
    "refuse_unsupported",
]


class APIError(Exception):
    """A request the server refuses, answered in OpenAI's error shape."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = (
            message,
            status,
            param,
            code,
            type,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def _number(body: dict, name: str, default, lo=None, hi=None, integer=False):
    v = body.get(name)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if not ok or isinstance(v, bool):
        kind = "an integer" if integer else "a number"
        raise APIError(f"'{name}' must be {kind}, got {v!r}", param=name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise APIError(f"'{name}' must be in [{lo}, {hi}], got {v!r}", param=name)
    return v


def _flag(body: dict, name: str, default: bool = False) -> bool:
    """A boolean field: ``true``, ``false`` or absent / null (``default``); anything else (a
    string ``"false"``, a number) is a 400, as the OpenAI API answers it."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError(
            f"'{name}' must be a boolean (true or false), got {v!r}",
            param=name,
            code="invalid_type",
        )
    return v


def _text_of(content: Any, where: str) -> str | None:
    """A message's content as text: a string, None, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                raise APIError(
                    f"{where}.content: only text parts are supported, got {p!r}", param="messages"
                )
        return "".join(parts)
    raise APIError(f"{where}.content must be a string or a list of text parts", param="messages")


def normalise_messages(messages: Any) -> list[dict]:
    """The request's messages in the form chat templates render: text content, tool calls
    with their arguments as objects (sent as JSON strings by the OpenAI client)."""
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list of messages", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in (
            "system",
            "developer",
            "user",
            "assistant",
            "tool",
        ):
            raise APIError(
                f"{where} must be an object with a role of system, user, assistant "
                f"or tool, got {str(m)[:200]}",
                param="messages",
            )
        msg = {"role": "system" if m["role"] == "developer" else m["role"]}
        msg["content"] = _text_of(m.get("content"), where)
        if msg["content"] is None and m["role"] != "assistant":
            raise APIError(f"{where} ({m['role']}) has no content", param="messages")
        for k in ("name", "tool_call_id"):
            if isinstance(m.get(k), str):
                msg[k] = m[k]
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise APIError(f"{where}.tool_calls must be a list", param="messages")
            norm = []
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise APIError(
                        f"{where}.tool_calls: each needs function.name", param="messages"
                    )
                args = fn.get("arguments", {})
                if isinstance(args, str):
                    with contextlib.suppress(json.JSONDecodeError):  # else as the client sent it
                        args = json.loads(args) if args.strip() else {}
                norm.append(
                    {"type": "function", "function": {"name": fn["name"], "arguments": args}}
                )
            msg["tool_calls"] = norm
        out.append(msg)
    return out


def canonical(m: dict) -> tuple:
    """What identifies a message when a follow-up is matched to a recorded conversation."""
    calls = tuple(
        (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
        for c in m.get("tool_calls") or []
    )
    return (m["role"], (m.get("content") or "").strip(), calls)


def check_tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or any(
        not isinstance(t, dict) or not isinstance((t.get("function") or {}).get("name"), str)
        for t in tools
    ):
        raise APIError(
            "'tools' must be a list of {type: function, function: {name, ...}}", param="tools"
        )
    return tools or None


def offered_tools(body: dict, settings: Settings) -> list[dict] | None:
    """A chat request's ``tools`` as the template renders them: None under ``tool_choice``
    ``none`` (as if none were offered, so the model cannot call one). A forced call
    (``required``, or a function by name) needs tools, and the named one among them."""
    tools = check_tools(body.get("tools"))
    if settings.tool_choice == "required" and not tools:
        raise APIError("'tool_choice' forces a tool call but no 'tools' are given", param="tools")
    names = [t["function"]["name"] for t in tools or []]
    if settings.forced_tool is not None and settings.forced_tool not in names:
        raise APIError(
            f"'tool_choice' names the function {settings.forced_tool!r}, which is not among "
            f"'tools' ({', '.join(names)})",
            param="tool_choice",
        )
    return None if settings.tool_choice == "none" else tools


def parse_tool_choice(v: Any) -> tuple[str, str | None]:
    """``tool_choice`` as (``auto`` | ``none`` | ``required``, the function it names or None):
    ``"auto"``, ``"none"``, ``"required"``, or ``{"type": "function", "function": {"name":
    ...}}`` (a call of that function, so ``required``)."""
    if v is None or v in ("auto", "none", "required"):
        return v or "auto", None
    fn = v.get("function") if isinstance(v, dict) and v.get("type") == "function" else None
    if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]:
        return "required", fn["name"]
    raise APIError(
        "'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", "
        f'"function": {{"name": ...}}}}, got {v!r}',
        param="tool_choice",
    )


def _sampling(n: int = 1, **fields) -> SamplerSettings:
    """A request's ``n``, temperature, top-p, top-k and stop strings as the one settings record
    (its ``max_new_tokens`` is not read: ``Settings.max_tokens``, which may be unset, is the
    budget)."""
    return SamplerSettings(n, 1, **fields)


@dataclass
class Settings:
    """A request's settings, checked: how to sample (``sampling``, the sampler's own record:
    ``n``, ``temperature`` (0 = greedy), ``top_p``, ``top_k`` (0 = off), ``stop``; read as
    ``settings.n`` ...), the budget the client asked for (``max_tokens``; None: the server's)
    and what the reply shows."""

    sampling: SamplerSettings = field(default_factory=_sampling)
    max_tokens: int | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    return_token_ids: bool = False
    echo: bool = False  # /v1/completions: the prompt before the text (and its log-probs)
    tool_choice: str = "auto"  # auto | none | required (a tool call is forced)
    forced_tool: str | None = None  # the function a forced call calls (None: the model picks)
    #: vLLM's ``prompt_logprobs``: each prompt token's log-prob and rank, with this many top
    #: tokens (None: not asked)
    prompt_logprobs: int | None = None
    #: vLLM's ``chat_template_kwargs``: extra variables for the chat template (e.g. Qwen3's
    #: ``enable_thinking``); None: none given
    template_kwargs: dict | None = None
    #: (field, why) of each field asked that this server cannot honour (a plain request is
    #: refused; a training episode ignores them: the trainer's sampling wins)
    unsupported: tuple[tuple[str, str], ...] = ()

    @property
    def n(self) -> int:
        return self.sampling.n

    @property
    def temperature(self) -> float:
        return self.sampling.temperature

    @property
    def top_p(self) -> float:
        return self.sampling.top_p

    @property
    def top_k(self) -> int:
        return self.sampling.top_k

    @property
    def stop(self) -> tuple[str, ...]:
        return self.sampling.stop


#: fields this server does not honour, when set to something that changes the reply
_NO_CONSTRAINTS = "there is no constrained decoding here"
_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "logit_bias": (lambda v: bool(v), "token biases are not applied"),
    "presence_penalty": (lambda v: v not in (0, 0.0), "penalties are not applied"),
    "frequency_penalty": (lambda v: v not in (0, 0.0), "penalties are not applied"),
    "repetition_penalty": (lambda v: v not in (1, 1.0), "penalties are not applied"),
    "min_tokens": (lambda v: v not in (0,), "eos is never suppressed"),
    "ignore_eos": (lambda v: bool(v), "eos is never suppressed"),
    "min_p": (lambda v: v not in (0, 0.0), "min-p filtering is not applied; use top_p / top_k"),
    "include_stop_str_in_output": (
        lambda v: bool(v),
        "the text leaves a stop string out, as OpenAI's does (return_token_ids keeps its tokens)",
    ),
    "use_beam_search": (lambda v: bool(v), "there is no beam search"),
    "best_of": (lambda v: v not in (1,), "use 'n' (every sample is returned)"),
    "truncate_prompt_tokens": (lambda v: True, "prompts are never truncated"),
    "suffix": (lambda v: v != "", "there is no insertion (fill-in-the-middle) here"),
    "response_format": (
        lambda v: not (isinstance(v, dict) and v.get("type") in (None, "text")),
        f"the reply is not forced into a format; {_NO_CONSTRAINTS}",
    ),
    **{
        k: (lambda v: v is not None, _NO_CONSTRAINTS)
        for k in (
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            "structured_outputs",
        )
    },
}


def _sampled_as(body: dict, n: int) -> SamplerSettings:
    """``temperature``, ``top_p``, ``top_k`` (-1 or 0: off) and ``stop`` of a request body (or
    of vLLM's ``sampling_params``), checked, with ``n``."""
    temperature = float(_number(body, "temperature", 1.0, 0, 2))
    top_p = float(_number(body, "top_p", 1.0, 0, 1))
    if top_p == 0:
        raise APIError("'top_p' must be > 0", param="top_p")
    top_k = max(int(_number(body, "top_k", 0, -1, None, integer=True)), 0)
    stop = _stop(body.get("stop"))
    return _sampling(n, temperature=temperature, top_p=top_p, top_k=top_k, stop=stop)


def parse_settings(body: dict, chat: bool) -> Settings:
    s = Settings()
    n = _number(body, "n", 1, 1, 128, integer=True)
    mt = body.get("max_completion_tokens") if chat else None
    echo = _flag(body, "echo")
    s.echo = not chat and echo
    if chat and echo:  # vLLM's chat extension (the last message repeated): not served
        raise APIError(
            "'echo' is not supported on /v1/chat/completions (it is a /v1/completions field)",
            param="echo",
            code="unsupported_parameter",
        )
    s.max_tokens = _number(
        body,
        "max_completion_tokens" if mt is not None else "max_tokens",
        None,
        0 if s.echo else 1,  # echo with nothing sampled: the prompt scored (lm-eval does it)
        None,
        integer=True,
    )
    s.sampling = _sampled_as(body, n)
    s.seed = _number(body, "seed", None, None, None, integer=True)
    if chat:
        s.logprobs = _flag(body, "logprobs")
        s.top_logprobs = _number(body, "top_logprobs", 0, 0, 20, integer=True)
        if s.top_logprobs and not s.logprobs:
            raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    else:
        lp = _number(body, "logprobs", None, 0, 20, integer=True)
        s.logprobs, s.top_logprobs = lp is not None, lp or 0
    s.stream = _flag(body, "stream")
    s.prompt_logprobs = _prompt_logprobs(body, s.stream)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise APIError("'stream_options' must be an object", param="stream_options")
    s.include_usage = bool(s.stream and opts and _flag(opts, "include_usage"))
    s.return_token_ids = _flag(body, "return_token_ids")
    if chat:
        s.tool_choice, s.forced_tool = parse_tool_choice(body.get("tool_choice"))
        s.template_kwargs = _template_kwargs(body.get("chat_template_kwargs"))
        for k, default in (("continue_final_message", False), ("add_generation_prompt", True)):
            if body.get(k) is not None and body[k] != default:  # vLLM's rendering switches
                raise APIError(
                    f"'{k}': {body[k]!r} is not supported; every reply starts a new assistant "
                    "turn after the generation prompt",
                    param=k,
                    code="unsupported_parameter",
                )
    s.unsupported = tuple(
        (k, why)
        for k, (bad, why) in _UNSUPPORTED.items()
        if body.get(k) is not None and bad(body[k])
    )
    return s


#: OpenAI's limit on stop sequences (its API says "up to 4"; vLLM and this server take 16)
MAX_STOP = 16


def _stop(stop: Any) -> tuple[str, ...]:
    """``stop``: a string or a list of at most ``MAX_STOP`` non-empty strings."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list) and all(isinstance(x, str) and x for x in stop):
        if len(stop) > MAX_STOP:
            raise APIError(
                f"'stop' has {len(stop)} strings; at most {MAX_STOP} are allowed", param="stop"
            )
        return tuple(stop)
    raise APIError("'stop' must be a string or a list of non-empty strings", param="stop")


def _prompt_logprobs(params: dict, stream: bool) -> int | None:
    """vLLM's ``prompt_logprobs`` (0-20 top tokens; not with ``stream``, as vLLM refuses it)."""
    k = params.get("prompt_logprobs")
    if k is not None and not (isinstance(k, int) and not isinstance(k, bool) and 0 <= k <= 20):
        raise APIError(
            f"'prompt_logprobs' must be an integer in [0, 20] (the top tokens beside each prompt "
            f"token; -1, the whole vocabulary, is not served), got {k!r}",
            param="prompt_logprobs",
        )
    if k is not None and stream:
        raise APIError("'prompt_logprobs' is not supported with 'stream'", param="prompt_logprobs")
    return k


#: ``apply_chat_template``'s own arguments: not template variables
_RENDER_ARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def _template_kwargs(v: Any) -> dict | None:
    """``chat_template_kwargs``: an object of template variables (not ``apply_chat_template``'s
    own arguments), or None."""
    if v is None or v == {}:
        return None
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise APIError(
            f"'chat_template_kwargs' must be an object of template variables, got {v!r}",
            param="chat_template_kwargs",
        )
    bad = sorted(set(v) & _RENDER_ARGS)
    if bad:
        raise APIError(
            f"'chat_template_kwargs' cannot set {', '.join(bad)} (not template variables)",
            param="chat_template_kwargs",
        )
    return dict(v)


def refuse_unsupported(settings: Settings) -> None:
    """A plain request asking for what this server cannot do gets a 400 naming the field."""
    if settings.unsupported:
        k, why = settings.unsupported[0]
        raise APIError(
            f"'{k}' is not supported by this server: {why}", param=k, code="unsupported_parameter"
        )


@dataclass
class TokenRequest:
    """A checked ``/inference/v1/generate`` request (vLLM's token-in route)."""

    prompt_ids: list[int]
    settings: Settings  # n, max_tokens, temperature, top_p, top_k, stop, seed, logprobs
    stop_ids: tuple[int, ...] = ()  # sampling_params.stop_token_ids: end a reply as eos does


def _is_token_ids(value: Any, vocab_size: int, empty_ok: bool = False) -> bool:
    return (
        isinstance(value, list)
        and (empty_ok or bool(value))
        and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in value
        )
    )


def _token_ids(value: Any, vocab_size: int, where: str, empty_ok: bool = False) -> list[int]:
    if _is_token_ids(value, vocab_size, empty_ok):
        return list(value)
    raise APIError(
        f"'{where}' must be a {'' if empty_ok else 'non-empty '}list of token ids in "
        f"[0, {vocab_size})",
        param=where,
    )


def parse_generate(body: dict, vocab_size: int) -> TokenRequest:
    """vLLM's ``POST /inference/v1/generate`` body: ``token_ids`` (the prompt) and
    ``sampling_params`` (vLLM's ``SamplingParams`` fields: ``n``, ``max_tokens`` (None when not
    given: 16 on ``peergrade serve``, as vLLM's default; the trainer's budget in an episode),
    ``temperature``, ``top_p``, ``top_k`` (-1 or 0: off), ``seed``, ``stop``,
    ``stop_token_ids``, ``logprobs`` (the top alternatives at each position besides the sampled
    token), ``prompt_logprobs``; those this server cannot honour are in ``settings.unsupported``). Multimodal
    inputs (``features``, ``content_parts``) and ``stream`` are refused."""
    prompt = _token_ids(body.get("token_ids"), vocab_size, "token_ids")
    for k in ("features", "content_parts"):
        if body.get(k):
            raise APIError(
                f"'{k}': this server takes text-only token prompts",
                param=k,
                code="unsupported_parameter",
            )
    if _flag(body, "stream"):
        raise APIError(
            "'stream' is not supported on /inference/v1/generate",
            param="stream",
            code="unsupported_parameter",
        )
    sp = body.get("sampling_params")
    sp = {} if sp is None else sp
    if not isinstance(sp, dict):
        raise APIError("'sampling_params' must be an object", param="sampling_params")
    s = Settings()
    n = _number(sp, "n", 1, 1, 128, integer=True)
    s.max_tokens = _number(sp, "max_tokens", None, 1, None, integer=True)  # None: not given
    s.sampling = _sampled_as(sp, n)
    s.seed = _number(sp, "seed", None, None, None, integer=True)
    lp = _number(sp, "logprobs", None, 0, 20, integer=True)
    s.logprobs, s.top_logprobs = lp is not None, lp or 0
    stop_ids = sp.get("stop_token_ids")
    stop_ids = [] if stop_ids is None else stop_ids
    stop_ids = _token_ids(stop_ids, vocab_size, "stop_token_ids", empty_ok=True)
    s.prompt_logprobs = _prompt_logprobs(sp, False)
    s.unsupported = tuple(
        (k, why) for k, (bad, why) in _UNSUPPORTED.items() if sp.get(k) is not None and bad(sp[k])
    )
    return TokenRequest(prompt, s, tuple(sorted(set(stop_ids))))


def parse_prompts(
    prompt: Any, encode: Callable[[str], list[int]], vocab_size: int
) -> list[list[int]]:
    """``/v1/completions``' ``prompt`` as token ids: a string (``encode``d), token ids, or a
    list of up to 128 of either (a batch)."""

    def ids_of(p) -> list[int] | None:
        if isinstance(p, str):
            return encode(p)
        return list(p) if _is_token_ids(p, vocab_size) else None

    one = ids_of(prompt)
    if one is not None:
        batch = [one]
    elif isinstance(prompt, list) and prompt and len(prompt) <= 128:
        batch = [ids_of(p) for p in prompt]
    else:
        batch = [None]
    for k, ids in enumerate(batch):
        where = "'prompt'" if len(batch) == 1 else f"'prompt[{k}]'"
        if ids is None:
            raise APIError(
                f"{where} must be a non-empty string or a list of token ids in [0, "
                f"{vocab_size}) (or 'prompt' a list of at most 128 of them)",
                param="prompt",
            )
        if not ids:
            raise APIError(f"{where} is empty", param="prompt")
    return batch
