"""Server-sent events of the endpoint's streamed replies (``"stream": true``).

A stream is filled one of two ways:

- **live** (``live_chat``, ``live_completion``: a request without ``logprobs``): every job
  hands its tokens to the event loop as the engine samples them (``server.Job.on_token``, from
  ``kernel.generate``'s ``on_tokens`` hook or the sessions' loop). The tokens so far are decoded
  and the text that is sure to begin the final reply is sent: a stop string and (with tools) a
  ``<tool_call>`` block are held back from their first character on, as are a trailing partial
  UTF-8 character and, with tools, the whitespace the final content is stripped of. When the
  job ends, the rest of the final content follows, then the tool calls and the finish reason,
  so the content deltas add up to the content of the same request without ``stream``;
- **replayed** (``replay_chat``: chat with ``logprobs``, whose top log-probs need a forward pass
  over the finished reply, and a training episode's request, recorded once its turn is over):
  the finished reply as chunks of one token each.

A completion streamed with ``logprobs`` is sent whole as one chunk. ``return_token_ids``: the
first chunk carries ``prompt_token_ids`` and the chunks carry the ``token_ids`` sampled since
the previous one, which add up to the reply's tokens. A failure while sampling ends the stream
with an ``error`` event in OpenAI's shape, then ``[DONE]``.

It does not batch or sample (``server.Engine``) or build the replies' choices (``server``
passes its ``chat_choice`` / ``completion_choice`` in: ``server`` imports this module, not the
other way round).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

DONE = "data: [DONE]\n\n"
_CALL_OPEN = "<tool_call>"


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def usage_of(prompt_ids: list[int], sampled: list) -> dict:
    done = sum(len(x.token_ids) for x in sampled)
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": done,
        "total_tokens": len(prompt_ids) + done,
    }


def _usage_event(rid: str, kind: str, created: int, model: str, usage: dict) -> str:
    """``stream_options.include_usage``: the last chunk, no choices and the request's usage."""
    body = {"id": rid, "object": kind, "created": created, "model": model, "choices": []}
    return _event({**body, "usage": usage})


def _choice_end(chunk: Callable, i: int, rest: str | None, choice: dict):
    """A chat choice's last chunks: the rest of its content (None: nothing to send), its tool
    calls, one each, then its finish reason."""
    if rest is not None:
        yield chunk(i, {"content": rest})
    for k, tc in enumerate(choice["message"].get("tool_calls") or []):
        yield chunk(i, {"tool_calls": [{"index": k, **tc}]})
    yield chunk(i, {}, choice["finish_reason"])


def _ending(settings, rid: str, kind: str, created: int, model: str, prompt_ids, sampled):
    """A stream's end: the usage chunk when asked (``stream_options``), then ``[DONE]``."""
    if settings.include_usage:
        yield _usage_event(rid, kind, created, model, usage_of(prompt_ids, sampled))
    yield DONE


def sure_prefix(text: str, holds: Sequence[str], strip: bool) -> str:
    """The part of a reply's text so far that its final content starts with, whatever is
    sampled next: cut at the first ``holds`` string (a stop string, a tool call), without a
    trailing partial character or a tail that may grow into a ``holds`` string, and (``strip``:
    the final content is stripped) without surrounding whitespace."""
    if strip:
        text = text.lstrip()
    for h in holds:
        i = text.find(h)
        if i >= 0:
            text = text[:i]
    while True:
        before = text
        text = text.rstrip("\ufffd")
        for h in holds:
            for k in range(min(len(h) - 1, len(text)), 0, -1):
                if text.endswith(h[:k]):
                    text = text[:-k]
                    break
        if strip:
            text = text.rstrip()
        if text == before:
            return text


class _Shown:
    """One choice of a live stream: its tokens so far, and the text and tokens already sent."""

    def __init__(self, tokenizer, holds: Sequence[str], strip: bool):
        self.tokenizer, self.holds, self.strip = tokenizer, tuple(holds), strip
        self.ids: list[int] = []
        self.text = ""  # sent
        self.unsent = 0  # tokens not yet named in a chunk's token_ids

    def add(self, token: int) -> str:
        """The new text that is sure (possibly '') after ``token``."""
        self.ids.append(token)
        self.unsent += 1
        sure = sure_prefix(
            self.tokenizer.decode(self.ids, skip_special_tokens=True), self.holds, self.strip
        )
        if len(sure) > len(self.text) and sure.startswith(self.text):
            new, self.text = sure[len(self.text) :], sure
            return new
        return ""

    def take_ids(self) -> list[int]:
        out = self.ids[len(self.ids) - self.unsent :] if self.unsent else []
        self.unsent = 0
        return out

    def rest(self, final: str) -> str:
        """What the final text adds to what was sent ('' if it does not extend it)."""
        return final[len(self.text) :] if final.startswith(self.text) else ""


def _start(engine, jobs: list):
    """Submit ``jobs`` with their tokens handed to a queue as the engine samples them:
    ``(queue of (job index, token), then None once all are done; the engine's future)``."""
    loop, q = asyncio.get_running_loop(), asyncio.Queue()

    def put(item) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop (server stopped): no listener
            loop.call_soon_threadsafe(q.put_nowait, item)

    for i, j in enumerate(jobs):
        j.on_token = lambda t, i=i: put((i, t))
    fut = engine.submit(jobs)
    fut.add_done_callback(lambda _: put(None))
    return q, fut


async def _sure_text(q: asyncio.Queue, shown: list[_Shown]):
    """``(job index, the new sure text)`` for every token, until the jobs are done."""
    while (item := await q.get()) is not None:
        i, token = item
        yield i, shown[i].add(token)


class _Live:
    """A live stream's ``events``: when the stream ends before them (the client disconnected:
    the server cancels the task that sends it, or closes the stream, even one never started),
    the engine's future is cancelled, so that the call sampling for it stops at its next
    token (``server._Gone``)."""

    def __init__(self, events, fut):
        self._events, self._fut = events, fut

    def __aiter__(self):
        return self

    async def __anext__(self) -> str:
        try:
            return await self._events.__anext__()
        except BaseException:  # the end (the future is done then), or a cancellation
            self._cancel()
            raise

    def _cancel(self) -> None:
        if not self._fut.done():
            self._fut.cancel()

    async def aclose(self) -> None:
        self._cancel()
        await self._events.aclose()


def _error_event(e: BaseException) -> str:
    """OpenAI's error shape (a ``server.APIError``'s own body, else a server error)."""
    if hasattr(e, "body"):
        return _event(e.body())
    msg = f"{type(e).__name__}: {e}"
    return _event({"error": {"message": msg, "type": "server_error", "param": None, "code": None}})


def live_chat(
    engine,
    model: str,
    settings,
    tools: bool,
    prompt_ids: list[int],
    jobs: list,
    choice_of: Callable[[int, Any], dict],
) -> AsyncIterator[str]:
    """The events of a chat completion streamed as it is sampled (see the module doc);
    ``choice_of(index, sampled)``: the unstreamed reply's choice."""
    rid, created = "chatcmpl-" + secrets.token_hex(12), int(time.time())
    holds = tuple(settings.stop) + ((_CALL_OPEN,) if tools else ())
    shown = [_Shown(engine.tokenizer, holds, strip=bool(tools)) for _ in jobs]
    q, fut = _start(engine, jobs)  # now: it joins the requests batched at this moment

    def chunk(index: int, delta: dict, finish=None, **extra) -> str:
        c: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None}
        c["finish_reason"] = finish
        if settings.return_token_ids and "token_ids" not in extra:
            extra["token_ids"] = shown[index].take_ids()
        c.update(extra)
        return _event(
            {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [c],
            }
        )

    async def events():
        for i in range(len(jobs)):
            extra = {"token_ids": []} if settings.return_token_ids else {}
            if settings.return_token_ids and i == 0:
                extra["prompt_token_ids"] = list(prompt_ids)
            yield chunk(i, {"role": "assistant", "content": ""}, **extra)
        async for i, new in _sure_text(q, shown):
            if new:
                yield chunk(i, {"content": new})
        try:
            sampled = fut.result()
        except Exception as e:  # the batch failed: say so in the stream, which has begun
            yield _error_event(e)
            yield DONE
            return
        for i, s in enumerate(sampled):
            ch = choice_of(i, s)
            rest = shown[i].rest(ch["message"]["content"] or "")
            send = rest or (settings.return_token_ids and shown[i].unsent)
            for c in _choice_end(chunk, i, rest if send else None, ch):
                yield c
        for c in _ending(
            settings, rid, "chat.completion.chunk", created, model, prompt_ids, sampled
        ):
            yield c

    return _Live(events(), fut)


def live_completion(
    engine,
    model: str,
    settings,
    prompt_ids: list[int],
    jobs: list,
    choice_of: Callable[[int, Any], dict],
    echo: str = "",
) -> AsyncIterator[str]:
    """The events of a plain completion streamed as it is sampled (``echo``: the prompt's text,
    sent first; ``choice_of``: as ``live_chat``'s, without the echo)."""
    rid, created = "cmpl-" + secrets.token_hex(12), int(time.time())
    shown = [_Shown(engine.tokenizer, settings.stop, strip=False) for _ in jobs]
    q, fut = _start(engine, jobs)

    def chunk(index: int, text: str, finish=None, **extra) -> str:
        c: dict[str, Any] = {"index": index, "text": text, "logprobs": None}
        c["finish_reason"] = finish
        if settings.return_token_ids and "token_ids" not in extra:
            extra["token_ids"] = shown[index].take_ids()
        c.update(extra)
        body = {"id": rid, "object": "text_completion", "created": created, "model": model}
        return _event({**body, "choices": [c]})

    async def events():
        if settings.return_token_ids or echo:
            for i in range(len(jobs)):
                extra = {"token_ids": []} if settings.return_token_ids else {}
                if settings.return_token_ids and i == 0:
                    extra["prompt_token_ids"] = list(prompt_ids)
                yield chunk(i, echo, **extra)
        async for i, new in _sure_text(q, shown):
            if new:
                yield chunk(i, new)
        try:
            sampled = fut.result()
        except Exception as e:
            yield _error_event(e)
            yield DONE
            return
        for i, s in enumerate(sampled):
            ch = choice_of(i, s)
            rest = shown[i].rest(ch["text"])
            if rest or (settings.return_token_ids and shown[i].unsent):
                yield chunk(i, rest)
            yield chunk(i, "", ch["finish_reason"])
        for c in _ending(settings, rid, "text_completion", created, model, prompt_ids, sampled):
            yield c

    return _Live(events(), fut)


def whole_completion(
    choices: list[dict], model: str, usage: dict | None = None
) -> AsyncIterator[str]:
    """A finished completion (one asked with ``logprobs``) as a stream: one chunk per choice
    (``usage``: then the usage chunk)."""
    rid, created = "cmpl-" + secrets.token_hex(12), int(time.time())

    async def events():
        for c in choices:
            body = {"id": rid, "object": "text_completion", "created": created, "model": model}
            yield _event({**body, "choices": [c]})
        if usage is not None:
            yield _usage_event(rid, "text_completion", created, model, usage)
        yield DONE

    return events()


def replay_chat(
    engine,
    rid: str,
    created: int,
    model: str,
    choices: list[dict],
    sampled: list,
    settings,
    prompt_ids: list[int],
) -> AsyncIterator[str]:
    """The events of a finished chat completion: a role chunk, one chunk per token of content,
    the tool calls, the finish reason, [DONE]."""
    tok = engine.tokenizer

    def chunk(index, delta, finish=None, **extra):
        c = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None, **extra}
        body = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [c],
        }
        return _event(body)

    async def events():
        for ch, s in zip(choices, sampled):
            i = ch["index"]
            first = {"role": "assistant", "content": ""}
            if settings.return_token_ids and i == choices[0]["index"]:
                yield chunk(i, first, prompt_token_ids=list(prompt_ids))
            else:
                yield chunk(i, first)
            content = ch["message"]["content"] or ""
            done, lps = 0, (ch.get("logprobs") or {}).get("content") or []
            for k in range(len(s.token_ids)):
                upto = min(
                    len(tok.decode(s.token_ids[: k + 1], skip_special_tokens=True)), len(content)
                )
                extra = {}
                if settings.return_token_ids:
                    extra["token_ids"] = [s.token_ids[k]]
                piece = content[done:upto] if upto > done else ""
                if piece or extra:
                    c = chunk(i, {"content": piece}, **extra)
                    if lps:
                        body = json.loads(c[6:])
                        body["choices"][0]["logprobs"] = {"content": [lps[k]]}
                        c = _event(body)
                    yield c
                done = max(done, upto)
            for c in _choice_end(chunk, i, content[done:] if done < len(content) else None, ch):
                yield c
        for c in _ending(
            settings, rid, "chat.completion.chunk", created, model, prompt_ids, sampled
        ):
            yield c

    return events()
