"""OpenAI's Responses API (``POST /v1/responses``) on top of the chat route.

Agents written for the Responses API (the OpenAI Agents SDK's default model, ``client.responses
.create`` loops) send ``input`` items instead of chat messages. A request is translated to the
chat completion it means, answered by the chat route (so a training episode records it exactly
as a chat request: the same tokens, the same matching of follow-ups), and the reply is
translated back:

- ``instructions`` is a system message before everything else (not carried over by
  ``previous_response_id``, as on OpenAI);
- ``input`` is a string (one user message) or a list of items: messages (``input_text`` /
  ``output_text`` parts), ``function_call`` items (they join the assistant message before
  them: one reply's text and tool calls are one assistant turn, as the model sampled it) and
  ``function_call_output`` items (tool messages); ``reasoning`` items are skipped (this server
  never sends them); other items (images, files, built-in tool calls) are refused;
- ``previous_response_id`` continues a stored response: its conversation (input and output)
  comes before ``input``. Responses are stored unless ``"store": false``; ``peergrade serve``
  keeps the last 1024 (at most ``STORE_BYTES`` of them), a training episode all of its own. ``GET /v1/responses/{id}`` returns a
  stored response, ``DELETE`` forgets it (``ResponseStore``);
- ``tools`` of type ``function``; ``tool_choice``, ``text.format`` and the rest are checked as
  the chat route checks them (what cannot be honoured is refused with a 400); ``metadata``
  as OpenAI checks it (``check_metadata``);
- the reply: a ``message`` item with one ``output_text`` part (when there is text or no tool
  call), then one ``function_call`` item per tool call; ``status`` ``incomplete`` with reason
  ``max_output_tokens`` when the reply ran out of tokens;
- ``stream``: the chat stream's chunks as Responses events (``response.created`` ...
  ``response.output_text.delta`` ... ``response.completed``), so text is streamed as it is
  sampled where the chat route streams live. The last event is ``response.completed`` also for
  an incomplete reply (its ``status`` says so), as vLLM sends it: the ``openai`` client's stream
  helper fails without it.

It does not sample or render (``server``) or record (``recorder``).
"""

from __future__ import annotations

import json
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from peergrade.serving.openai_schema import APIError

#: vLLM-style extras passed to the chat route as they are
_PASSED = ("seed", "top_k", "stop", "model")
#: chat fields by the Responses fields they come from (an error names the one sent)
_NAMES = {
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
}


#: the Responses store's default bound on the bytes it keeps (the JSON of its entries)
STORE_BYTES = 64 * 2**20

#: OpenAI's limits on ``metadata``: keys, a key's and a value's characters
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


def check_metadata(v: Any) -> dict:
    """``metadata`` as OpenAI checks it: an object of at most 16 string keys of at most 64
    characters, each value a string of at most 512."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise APIError(f"'metadata' must be an object, got {type(v).__name__}", param="metadata")
    if len(v) > METADATA_KEYS:
        raise APIError(
            f"'metadata' has {len(v)} keys; at most {METADATA_KEYS} are allowed",
            param="metadata",
        )
    for k, x in v.items():
        if len(k) > METADATA_KEY_CHARS:
            raise APIError(
                f"'metadata' key {k[:80]!r}... has {len(k)} characters; at most "
                f"{METADATA_KEY_CHARS} are allowed",
                param="metadata",
            )
        if not isinstance(x, str) or len(x) > METADATA_VALUE_CHARS:
            got = f"{len(x)} characters" if isinstance(x, str) else type(x).__name__
            raise APIError(
                f"'metadata.{k}' must be a string of at most {METADATA_VALUE_CHARS} "
                f"characters, got {got}",
                param="metadata",
            )
    return dict(v)


class ResponseStore:
    """Stored responses by id (the most recent ``limit``): each one's conversation (what
    ``previous_response_id`` continues) and the response object (``GET /v1/responses/{id}``)."""

    def __init__(self, limit: int | None = 1024, max_bytes: int | None = STORE_BYTES):
        self.limit, self.max_bytes = limit, max_bytes
        self._items: OrderedDict[str, tuple[list[dict], dict]] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self.bytes = 0  # the stored entries' size (their JSON)

    def put(self, rid: str, conversation: list[dict], response: dict) -> None:
        """Store ``rid``; the oldest entries go while there are more than ``limit`` or they
        take more than ``max_bytes`` (an entry larger than that alone is not kept, and
        drops nothing)."""
        size = len(json.dumps([conversation, response], default=repr))
        if self.max_bytes is not None and size > self.max_bytes:
            return  # a later previous_response_id to it is a 404 saying so
        self._items[rid] = (conversation, response)
        self._sizes[rid] = size
        self.bytes += size
        while self._items and (
            (self.limit is not None and len(self._items) > self.limit)
            or (self.max_bytes is not None and self.bytes > self.max_bytes)
        ):
            old, _ = self._items.popitem(last=False)
            self.bytes -= self._sizes.pop(old)

    def get(self, rid: Any) -> list[dict]:
        """The conversation of ``previous_response_id`` ``rid``."""
        if not isinstance(rid, str) or rid not in self._items:
            raise APIError(
                f"previous response with id {rid!r} not found (never stored, sent with "
                "'store': false, or dropped as one of the oldest)",
                status=404,
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return self._items[rid][0]

    def retrieve(self, rid: str) -> dict:
        """``GET /v1/responses/{rid}``: the stored response object."""
        if rid not in self._items:
            raise APIError(
                f"response with id {rid!r} not found (never stored, sent with 'store': false, "
                "deleted, or dropped as one of the oldest)",
                status=404,
                code="not_found",
            )
        return self._items[rid][1]

    def delete(self, rid: str) -> dict:
        """``DELETE /v1/responses/{rid}``: forget it (a later follow-up by its id is a 404)."""
        self.retrieve(rid)
        del self._items[rid]
        self.bytes -= self._sizes.pop(rid)
        return {"id": rid, "object": "response.deleted", "deleted": True}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for k, p in enumerate(content):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind in ("input_text", "output_text", "text", "refusal"):
                text = p.get("refusal") if kind == "refusal" else p.get("text")
                if isinstance(text, str):
                    out.append(text)
                    continue
            raise APIError(
                f"{where}.content[{k}]: only text parts are supported (input_text, "
                f"output_text), got {str(p)[:200]}",
                param="input",
            )
        return "".join(out)
    raise APIError(f"{where}.content must be a string or a list of text parts", param="input")


def _messages(items: Any, history: list[dict]) -> list[dict]:
    """``input`` as chat messages (OpenAI's chat format, as a chat client sends them); a tool
    message is named after its call, found in ``input`` or the ``history`` it continues."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError("'input' must be a string or a non-empty list of items", param="input")
    out: list[dict] = []
    names = {  # call_id -> function name
        c.get("id"): c["function"]["name"] for m in history for c in m.get("tool_calls") or []
    }
    for i, it in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise APIError(f"{where} must be an object, got {str(it)[:200]}", param="input")
        kind = it.get("type") or ("message" if "role" in it else None)
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(
                    f"{where}.role must be user, system, developer or assistant, got {role!r}",
                    param="input",
                )
            out.append({"role": role, "content": _text(it.get("content"), where)})
        elif kind == "function_call":
            call_id, name, args = it.get("call_id"), it.get("name"), it.get("arguments")
            if not all(isinstance(x, str) for x in (call_id, name, args)):
                raise APIError(
                    f"{where} (function_call) needs call_id, name and arguments (strings)",
                    param="input",
                )
            names[call_id] = name
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            if out and out[-1]["role"] == "assistant":  # the same reply's text and calls
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = it.get("call_id")
            if not isinstance(call_id, str):
                raise APIError(f"{where} (function_call_output) needs call_id", param="input")
            output = it.get("output")
            msg = {"role": "tool", "tool_call_id": call_id, "content": _text(output, where)}
            if call_id in names:
                msg["name"] = names[call_id]
            out.append(msg)
        elif kind == "reasoning":
            continue
        else:
            raise APIError(
                f"{where}: items of type {kind!r} are not supported (messages, function_call, "
                "function_call_output)",
                param="input",
                code="unsupported_parameter",
            )
    return out


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise APIError("'tools' must be a list", param="tools")
    out = []
    for k, t in enumerate(tools):
        if isinstance(t, dict) and isinstance(t.get("function"), dict):  # chat form
            out.append(t)
        elif isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str):
            fn = {x: t[x] for x in ("name", "description", "parameters") if t.get(x) is not None}
            out.append({"type": "function", "function": fn})
        else:
            kind = t.get("type") if isinstance(t, dict) else None
            raise APIError(
                f"tools[{k}]: only function tools ({{type: function, name, parameters}}) are "
                f"supported, got type {kind!r}",
                param="tools",
                code="unsupported_parameter",
            )
    return out or None


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


class Request:
    """A checked Responses request: the chat body it means and what the reply echoes."""

    def __init__(self, body: dict, store: ResponseStore):
        for k in ("background", "conversation", "prompt"):
            if body.get(k):
                raise APIError(
                    f"'{k}' is not supported by this server", param=k, code="unsupported_parameter"
                )
        self.body, self.rid, self.created = body, "resp_" + secrets.token_hex(12), time.time()
        self.metadata = check_metadata(body.get("metadata"))
        history = []
        if body.get("previous_response_id") is not None:
            history = list(store.get(body["previous_response_id"]))
        self.history = history + _messages(body.get("input"), history)
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise APIError("'instructions' must be a string", param="instructions")
        system = [{"role": "system", "content": instructions}] if instructions else []
        chat = {k: body[k] for k in _PASSED if k in body}
        chat["messages"] = system + self.history
        tools = _tools(body.get("tools"))
        if tools:
            chat["tools"] = tools
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
        fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
        if fmt is not None:
            chat["response_format"] = fmt
        for ours, theirs in (
            ("max_output_tokens", "max_completion_tokens"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
        ):
            if body.get(ours) is not None:
                chat[theirs] = body[ours]
        if body.get("top_logprobs"):
            chat["logprobs"], chat["top_logprobs"] = True, body["top_logprobs"]
        if body.get("stream"):
            chat["stream"], chat["stream_options"] = True, {"include_usage": True}
        self.chat = chat

    def response(self, message: dict, finish: str, usage: dict | None, logprobs=None) -> dict:
        """The Responses object of a chat reply (``message``: the choice's message)."""
        b, output = self.body, []
        content, calls = message.get("content"), message.get("tool_calls") or []
        done = "incomplete" if finish == "length" else "completed"
        if content or not calls:
            part = {**_part(content or ""), "logprobs": logprobs or []}
            output.append(
                {
                    "type": "message",
                    "id": "msg_" + secrets.token_hex(12),
                    "status": done,
                    "role": "assistant",
                    "content": [part],
                }
            )
        for c in calls:
            output.append(
                {
                    "type": "function_call",
                    "id": "fc_" + secrets.token_hex(12),
                    "call_id": c["id"],
                    "name": c["function"]["name"],
                    "arguments": c["function"]["arguments"],
                    "status": "completed",
                }
            )
        u = usage or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "completed_at": time.time(),
            "status": done,
            "incomplete_details": {"reason": "max_output_tokens"} if done != "completed" else None,
            "error": None,
            "model": self.chat.get("model"),
            "instructions": b.get("instructions"),
            "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "tool_choice": b.get("tool_choice", "auto"),
            "tools": b.get("tools") or [],
            "temperature": b.get("temperature"),
            "top_p": b.get("top_p"),
            "max_output_tokens": b.get("max_output_tokens"),
            "previous_response_id": b.get("previous_response_id"),
            "metadata": self.metadata,
            "text": b.get("text") or {"format": {"type": "text"}},
            "truncation": b.get("truncation", "disabled"),
            "store": b.get("store", True),
            "background": False,
            "user": b.get("user"),
            "usage": {
                "input_tokens": u["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["total_tokens"],
            },
        }

    def keep(self, store: ResponseStore, message: dict, response: dict) -> dict:
        """Store the conversation so far (``previous_response_id`` continues it) and the
        response; returns the response."""
        if self.body.get("store", True):
            reply = {"role": "assistant", "content": message.get("content")}
            if message.get("tool_calls"):
                reply["tool_calls"] = message["tool_calls"]
            store.put(self.rid, self.history + [reply], response)
        return response

    def from_chat(self, chat: dict, store: ResponseStore) -> dict:
        choice = chat["choices"][0]
        lps = (choice.get("logprobs") or {}).get("content")
        response = self.response(choice["message"], choice["finish_reason"], chat.get("usage"), lps)
        return self.keep(store, choice["message"], response)

    async def events(self, chunks: AsyncIterator[str], store: ResponseStore):
        """The chat stream's server-sent events as the Responses API's."""
        out = _Events()
        live = self.response({"content": ""}, "stop", None)
        live.update(status="in_progress", output=[], usage=None, completed_at=None)
        yield out.event("response.created", response=live)
        yield out.event("response.in_progress", response=live)
        finish, usage = "stop", None
        async for raw in chunks:
            data = raw[len("data: ") :].strip() if raw.startswith("data: ") else ""
            if data == "[DONE]" or not data:
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                e = chunk["error"]
                yield out.event(
                    "error", message=e.get("message"), code=e.get("code"), param=e.get("param")
                )
                return
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices") or []:
                delta = c.get("delta") or {}
                for ev in out.text(delta.get("content") or ""):
                    yield ev
                for tc in delta.get("tool_calls") or []:
                    for ev in out.call(tc):
                        yield ev
                finish = c.get("finish_reason") or finish
        for ev in out.close():
            yield ev
        message = {"role": "assistant", "content": out.content or None, "tool_calls": out.calls}
        response = self.keep(store, message, self.response(message, finish, usage))
        # always response.completed (the response's status says incomplete), as vLLM sends
        # it: the openai client's stream helper fails without that event
        yield out.event("response.completed", response=response)


class _Events:
    """The output items of a streamed response, as Responses events (``Request.events``)."""

    def __init__(self):
        self.seq, self.index, self.item = 0, 0, None  # item: the message being streamed
        self.content, self.calls = "", []

    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    def _at(self) -> dict:
        return {"item_id": self.item["id"], "output_index": self.index, "content_index": 0}

    def text(self, delta: str):
        if not delta:
            return
        if self.item is None:
            yield from self._open_text()
        self.content += delta
        yield self.event("response.output_text.delta", delta=delta, logprobs=[], **self._at())

    def _open_text(self):
        self.item = {
            "type": "message",
            "id": "msg_" + secrets.token_hex(12),
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        yield self.event("response.output_item.added", item=self.item, output_index=self.index)
        yield self.event("response.content_part.added", part=_part(""), **self._at())

    def _close_text(self):
        if self.item is not None:
            part = _part(self.content)
            yield self.event(
                "response.output_text.done", text=self.content, logprobs=[], **self._at()
            )
            yield self.event("response.content_part.done", part=part, **self._at())
            done = {**self.item, "status": "completed", "content": [part]}
            yield self.event("response.output_item.done", item=done, output_index=self.index)
            self.index, self.item = self.index + 1, None

    def call(self, tc: dict):
        """One tool call of the chat stream (each comes whole) as a function_call item."""
        yield from self._close_text()
        self.calls.append({"id": tc["id"], "type": "function", "function": tc["function"]})
        name, args = tc["function"]["name"], tc["function"]["arguments"]
        fc = {
            "type": "function_call",
            "id": "fc_" + secrets.token_hex(12),
            "call_id": tc["id"],
            "name": name,
            "arguments": "",
            "status": "in_progress",
        }
        at = {"item_id": fc["id"], "output_index": self.index}
        yield self.event("response.output_item.added", item=fc, output_index=self.index)
        yield self.event("response.function_call_arguments.delta", delta=args, **at)
        yield self.event("response.function_call_arguments.done", name=name, arguments=args, **at)
        fc = {**fc, "arguments": args, "status": "completed"}
        yield self.event("response.output_item.done", item=fc, output_index=self.index)
        self.index += 1

    def close(self):
        """The end: the message item closed (an empty one when nothing else was sent)."""
        if self.item is None and not self.calls:
            yield from self._open_text()
        yield from self._close_text()


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def answer(
    body: dict, store: ResponseStore, chat: Callable[[dict], Awaitable[Any]]
) -> dict | AsyncIterator[str]:
    """A Responses request answered through ``chat`` (the chat route's handler of a body)."""
    if not isinstance(body.get("model"), str):
        raise APIError("'model' is required", param="model")
    req = Request(body, store)
    try:
        result = await chat(req.chat)
    except APIError as e:  # named as the Responses request names it
        if e.param in _NAMES:
            e.message = e.message.replace(f"'{e.param}'", f"'{_NAMES[e.param]}'")
            e.param = _NAMES[e.param]
        raise
    if isinstance(result, dict):
        return req.from_chat(result, store)
    return req.events(result, store)
