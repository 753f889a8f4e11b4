"""Training episodes recorded from an external agent's HTTP requests, token-exactly.

The trainer opens one ``Recording`` per (prompt, sample) and gives the agent (a "harness") the
base URL ``<server>/v1/episodes/<id>/<key>`` (``Recording.path``): ``<id>`` names the episode
(``ep1``, ``ep2``, ...: in errors and the KV cache's sessions), ``<key>`` is a random secret of
that episode alone. A request whose key is not its episode's is a 404, as for an episode that
is not open, and changes nothing: an agent that learns another open episode's id cannot
write into that episode's record (the whole URL is the credential: a client built with
another episode's full base URL is that episode's client). Every
chat request under it is answered by the policy,
and recorded as tokens into one ``envs.Episode``, the record the in-process episode engine
(``generation.episodes``) builds:

- the first request's messages (and tools) are rendered by the chat template with the
  generation prompt: the episode's prompt;
- each reply's sampled tokens are appended as they were sampled (loss mask 1, the sampler's
  log-probs: the full tempered distribution's, as the engine records them);
- a follow-up request whose messages extend the recorded conversation (the earlier messages and
  the assistant replies as this server sent them; tool call ids and whitespace around content
  are not compared) is matched to it: only the new messages are rendered, as the chat template's
  token delta after the recorded turn (``envs.template.turn_delta``; loss mask 0). The sampled
  turns are never decoded and re-encoded;
- a follow-up that changes the history (an edited or dropped message, a summarised context)
  cannot extend the recorded tokens: the episode is split. The new request starts a new segment
  (its messages rendered afresh as its prompt) and ``splits`` counts it; the episode handed to
  the trainer is the last segment (earlier segments are kept in ``segments`` but not trained on);
- a ``/completions`` request is recorded as text: its prompt string is encoded, and a
  follow-up whose text starts with what the record stands for (``Recording.text``: the prompt
  as sent, the replies' tokens decoded, the text added since) has the rest encoded and
  appended (loss mask 0); any other text is a split. A prompt of token ids is a token request
  (``/inference/v1/generate``'s: the ids extend the recorded ones, or split);
- a client that gives up waiting (its timeout) or loses the connection and sends the same
  request again, marked as a retry (the ``openai`` client's ``x-stainless-retry-count``
  header, which LangChain, LiteLLM, the Agents SDK and verifiers send through it), gets the
  answer recorded for the first attempt (``retries`` counts them): sampling it again would
  record a turn the client never saw, and split the episode at its next request. An unmarked
  repeat is a request of its own (an agent may ask the same question again on purpose).

The trainer's sampling settings win over the client's (temperature, top-p, top-k, stop, the
seed: the draws of turn ``k`` are keyed by (seed, episode key, k)); the client's
``max_tokens`` can only shorten a turn; what a plain request would be refused for
(penalties, ``logit_bias``, ``response_format``, ``min_p``) is ignored; the ``tool_choice``
is the plain route's: ``none`` renders no tools, and a forced call (``required`` or a named
function) feeds the start of a call (``server.forced_prefix``, loss mask 0) before the turn
is sampled, so the reply is a call, as the agent asked. The budgets are the
engine's: ``max_completion_length`` tokens after the prompt, ``max_tokens_per_turn``,
``max_turns``; a request past a budget gets an empty reply with finish_reason ``length``
(nothing is sampled), and the episode's ``finish_reason`` says which budget ended it, as in
the engine.

It does not run the agent (``serving.harness``) or score anything.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import threading
from dataclasses import dataclass, field, replace

from peergrade.envs.episode import Episode
from peergrade.envs.template import TemplateError, turn_delta
from peergrade.generation.record import SamplerSettings
from peergrade.serving.openai_schema import (
    APIError,
    canonical,
    parse_prompts,
)
from peergrade.serving.responses import ResponseStore
from peergrade.serving.server import (
    Handler,
    Job,
    Sampled,
    forced_prefix,
    mix_key,
    render_prompt,
)


@dataclass(frozen=True)
class EpisodeSettings:
    """What the trainer imposes on one episode's requests: its sampling (``sampling``: the
    temperature, top-p, top-k and stop strings, and the budgets: ``max_new_tokens`` of the
    whole episode after its prompt, ``max_turns``, ``max_tokens_per_turn``), the draws' seed
    and the episode's key ((prompt's global index, sample index) mixed)."""

    sampling: SamplerSettings
    seed: int = 0
    key: int = 0


@dataclass
class Recording:
    """One episode being recorded (see the module doc)."""

    eid: str
    row_index: int
    settings: EpisodeSettings
    #: the episode's secret: its URL's last part (``path``); requests without it are refused
    key: str = field(default_factory=lambda: secrets.token_urlsafe(18), repr=False)
    episode: Episode | None = None  # the current segment
    segments: list[Episode] = field(default_factory=list)  # earlier segments (after splits)
    messages: list[dict] = field(default_factory=list)  # the current segment's conversation
    tools: list[dict] | None = None
    template_kwargs: dict | None = None  # the segment's chat_template_kwargs
    last_end: str | None = None  # how the last sampled turn ended: eos | stop | length
    turns: int = 0  # turns sampled over all segments: the key of the next turn's draws
    requests: int = 0
    splits: int = 0
    retries: int = 0  # requests the client re-sent, answered again (``_one_at_a_time``)
    last: tuple | None = None  # ((route, body), answer) of the last answered request
    closed: bool = False
    lock: asyncio.Lock | None = None
    #: the current segment's requests: chat (messages) | tokens (token ids) | text (prompts)
    kind: str = ""
    #: (kind text) what the segment's tokens stand for: the prompt as sent, then each reply's
    #: tokens decoded (all of them: a stop string and what its token held after it too) and
    #: each appended text as sent
    text: str = ""
    #: the episode's Responses API replies (``previous_response_id``), all of them
    stored: ResponseStore = field(default_factory=lambda: ResponseStore(limit=None, max_bytes=None))

    @property
    def path(self) -> str:
        """The episode's base path on the server, ``/v1/episodes/<id>/<key>``: the agent's
        base URL after the server's address."""
        return f"/v1/episodes/{self.eid}/{self.key}"


def _imposed(asked, s: EpisodeSettings):
    """The client's settings with the trainer's sampling in place (temperature, top-p, top-k,
    stop strings; no seed): the client keeps only what cannot change the policy's draws."""
    return replace(asked, sampling=s.sampling.replace(n=asked.n), seed=None)


async def _events(events: list[str]):
    for e in events:
        yield e


def _again(answer):
    """A recorded answer as the route returns it: the dict, or its stream's events anew."""
    return answer if isinstance(answer, dict) else _events(answer)


class Recorder:
    """The episodes a server records, by id. ``open`` and ``close`` are called by the trainer
    (any thread); the server's routes answer an episode's requests the ``way`` it gives
    (``Recorded``), on the server's event loop."""

    def __init__(self, engine):
        self.engine = engine
        self._by_id: dict[str, Recording] = {}
        self._mutex = threading.Lock()
        self._ids = itertools.count(1)

    def open_count(self) -> int:
        """Episodes open now: the most requests that can be waiting at once."""
        return len(self._by_id)

    def open(self, row_index: int, settings: EpisodeSettings) -> Recording:
        with self._mutex:
            rec = Recording(f"ep{next(self._ids)}", row_index, settings)
            self._by_id[rec.eid] = rec
        return rec

    def close(self, eid: str) -> Recording:
        """Stop recording ``eid`` (later requests are refused) and forget it."""
        with self._mutex:
            rec = self._by_id.pop(eid)
        rec.closed = True
        self.engine.forget(eid)
        return rec

    def get(self, eid: str, key: str) -> Recording:
        """The open episode ``eid`` when ``key`` is its key (compared in constant time); else
        a 404 that says no more than for an episode never opened."""
        with self._mutex:
            rec = self._by_id.get(eid)
        known = rec is not None and secrets.compare_digest(rec.key.encode(), key.encode())
        if not known or rec.closed:
            raise APIError(
                f"no open training episode at /v1/episodes/{eid}/... with this key (finished, "
                "timed out, never opened, or the URL is another episode's: each episode's "
                "agent must use the base URL it was given)",
                status=404,
                code="episode_not_found",
            )
        return rec

    def way(self, rec: Recording) -> Recorded:
        """How the server's routes answer a request of ``rec`` (``Recorded``)."""
        return Recorded(self, rec)

    async def _one_at_a_time(self, rec: Recording, request, key: tuple, retry: bool):
        """``request`` run once the episode's earlier requests are answered (each extends the
        last). A retry of the episode's last request (``retry`` and the same route and body:
        the client gave up waiting, or lost the connection, and sends it again) gets the
        answer already recorded for it, the same object or stream again, and samples
        nothing: sampling it again would record a turn the client never saw, and split the
        episode at its next request."""
        if rec.lock is None:
            rec.lock = asyncio.Lock()
        async with rec.lock:
            if rec.closed:
                request.close()
                raise APIError(
                    f"training episode {rec.eid!r} is over", status=404, code="episode_not_found"
                )
            if retry and rec.last is not None and rec.last[0] == key:
                request.close()
                rec.retries += 1
                return _again(rec.last[1])
            result = await request
            if not isinstance(result, dict):  # a stream: its events kept for a retry
                result = [event async for event in result]
            rec.last = (key, result)
            return _again(result)

    def _token_segment(self, rec: Recording, ids: list[int]) -> Episode:
        """The segment token ids ``ids`` go on: the current one when they extend its tokens
        after a sampled turn (the rest appended), else a new one with them as its prompt."""
        ep = rec.episode
        held = ep.input_ids if ep is not None else []
        if (
            ep is not None
            and rec.kind == "tokens"
            and rec.last_end is not None
            and ids[: len(held)] == held
        ):
            if not ep.finish_reason and len(ids) > len(held):
                self._extend(rec, ids[len(held) :], None)
            return ep
        text = self.engine.tokenizer.decode(ids, skip_special_tokens=True)
        return self._new_segment(rec, list(ids), text, "tokens")

    def _text_segment(self, rec: Recording, text: str, ids: list[int]) -> Episode:
        """The segment a text prompt goes on: the current one when the text starts with what
        its tokens stand for (``Recording.text``: the replies' tokens are never re-encoded;
        the rest of the text is encoded and appended, loss mask 0), else a new one with
        ``ids`` (the text encoded) as its prompt."""
        ep = rec.episode
        if (
            ep is not None
            and rec.kind == "text"
            and rec.last_end is not None
            and text.startswith(rec.text)
        ):
            new = text[len(rec.text) :]
            fed = self.engine.encode(new) if new else []
            if fed and not ep.finish_reason:
                self._extend(rec, fed, [{"role": "user", "content": new}])
                rec.text += new
            return ep
        ep = self._new_segment(rec, list(ids), text, "text")
        rec.text = text
        return ep

    def _new_segment(self, rec: Recording, ids: list[int], text: str, kind: str) -> Episode:
        """A new segment with ``ids`` as its prompt (the current one kept: a split)."""
        self._check_fits(len(ids))
        if rec.episode is not None:
            rec.splits += 1
            rec.segments.append(rec.episode)
        ep = Episode(rec.row_index, ids, [{"role": "user", "content": text}], 1)
        rec.episode, rec.messages, rec.tools, rec.last_end = ep, [], None, None
        rec.kind = kind
        return ep

    def _check_fits(self, n: int) -> None:
        if n >= self.engine.max_pos:
            raise APIError(
                f"this model's maximum context length is {self.engine.max_pos} tokens; the "
                f"request has {n}",
                param="messages",
                code="context_length_exceeded",
            )

    def _segment(self, rec: Recording, messages: list[dict], tools, tkw=None) -> Episode:
        """The segment ``messages`` go on: the current one when they extend it (their new
        messages appended, unless it has ended), else a new one with them as its prompt (the
        current one kept in ``segments``, a split)."""
        ep = rec.episode
        if ep is not None and self._extends(rec, messages, tools, tkw):
            if not ep.finish_reason:
                self._append(rec, messages[len(rec.messages) :])
        else:
            if ep is not None:
                rec.splits += 1
                rec.segments.append(ep)
            prompt = render_prompt(self.engine, messages, tools, tkw)
            self._check_fits(len(prompt))
            ep = Episode(rec.row_index, prompt, list(messages), len(messages))
            rec.episode, rec.messages, rec.tools, rec.last_end = ep, list(messages), tools, None
            rec.template_kwargs = tkw
            rec.kind = "chat"
        return ep

    def _extends(self, rec: Recording, messages: list[dict], tools, tkw=None) -> bool:
        """Whether ``messages`` continue the recorded conversation after a sampled reply
        (with the same tools and template variables, so it renders as it did)."""
        n = len(rec.messages)
        return (
            rec.kind == "chat"
            and rec.last_end is not None
            and tools == rec.tools
            and tkw == rec.template_kwargs
            and len(messages) > n
            and all(canonical(a) == canonical(b) for a, b in zip(messages, rec.messages))
        )

    def _append(self, rec: Recording, new: list[dict]) -> None:
        """The template's token delta of ``new`` after the recorded turn (loss mask 0)."""
        try:
            delta = turn_delta(
                self.engine.tokenizer,
                rec.messages,
                new,
                eos_ids=self.engine.eos_ids,
                tools=rec.tools,
                chat_template=self.engine.chat_template,
                template_kwargs=rec.template_kwargs,
                close_turn=rec.last_end != "eos",
            )
        except TemplateError as e:
            raise APIError(str(e), param="messages", code="template_error") from e
        self._extend(rec, delta, new)

    def _extend(self, rec: Recording, delta: list[int], new: list[dict] | None) -> None:
        """``delta`` appended (loss mask 0): the template tokens of the messages ``new``, or
        (None: a token request) a token request's own tokens, recorded as a user message of
        their text. Past a budget the episode ends instead (``env_over_budget``), as the
        in-process engine ends it."""
        ep, s = rec.episode, rec.settings
        total = len(ep.completion_ids) + len(delta)
        if total > s.sampling.max_new_tokens or len(ep.prompt_ids) + total > self.engine.max_pos:
            ep.finish_reason = "env_over_budget"  # dropped, as the engine drops it
            return
        if new is None:
            text = self.engine.tokenizer.decode(delta, skip_special_tokens=True)
            new = [{"role": "user", "content": text}]
        else:
            rec.messages += new
        ep.messages += new
        ep.completion_ids += delta
        ep.loss_mask += [0] * len(delta)
        ep.logprobs += [0.0] * len(delta)
        ep.sampler_logprobs += [0.0] * len(delta)


class Recorded:
    """A training episode's way of answering a request, with ``server.Plain``'s methods (the
    server's routes call them): the prompt extends the recorded episode (or splits it: see
    the module doc), the trainer's settings win, one reply per request, recorded as tokens
    and sent whole (a stream is replayed). One per request."""

    live = False  # the reply is recorded, then sent

    def __init__(self, recorder: Recorder, rec: Recording):
        self.recorder, self.rec, self.engine = recorder, rec, recorder.engine
        self.top = True  # the client's top log-probs are computed (not on the token route)
        self.max_tokens: int | None = None  # the client's, of this request (``jobs``)

    def check(self, asked) -> None:
        if asked.n != 1:
            raise APIError("a training episode samples one reply per request ('n': 1)", param="n")

    def settings(self, asked):
        return _imposed(asked, self.rec.settings)

    def stored(self, handler: Handler) -> ResponseStore:
        return self.rec.stored

    async def chat_prompt(self, handler: Handler, messages, tools, asked):
        """(the episode's tokens so far, forced prefix text): the messages extend the
        recorded conversation (or split it), then a forced call's start is fed (mask 0)."""
        rec = self.rec
        rec.requests += 1
        prefix, fed = forced_prefix(self.engine, tools, asked)  # before the record changes
        ep = self.recorder._segment(rec, messages, tools, asked.template_kwargs)
        if fed and not ep.finish_reason:  # a forced call's start, fed, not sampled: mask 0
            self.recorder._extend(rec, list(fed), [])
        return ep.prompt_ids + ep.completion_ids, prefix

    async def text_prompts(self, handler: Handler, raw) -> list[list[int]]:
        """A ``/v1/completions`` prompt: token ids go on as a token request's do
        (``_token_segment``), a string as text (``_text_segment``)."""
        tok, rec = self.engine.tokenizer, self.rec
        prompts = parse_prompts(raw, self.engine.encode, len(tok))
        if len(prompts) != 1:
            raise APIError("a training episode takes one prompt per request", param="prompt")
        text = raw if isinstance(raw, str) else raw[0] if isinstance(raw[0], str) else None
        rec.requests += 1
        if text is None:
            ep = self.recorder._token_segment(rec, prompts[0])
        else:
            ep = self.recorder._text_segment(rec, text, prompts[0])
        return [ep.prompt_ids + ep.completion_ids]

    def token_prompt(self, handler: Handler, ids: list[int]) -> list[int]:
        """A token-in request (vLLM's ``/inference/v1/generate``, as verifiers'
        ``TrainClient`` sends it): its ids extend the recorded ones (the rest appended, mask
        0) or start a new segment. No top log-probs here: the trainer's sampling."""
        self.rec.requests += 1
        self.top = False
        ep = self.recorder._token_segment(self.rec, ids)
        return ep.prompt_ids + ep.completion_ids

    def jobs(self, handler: Handler, prompts, asked, max_tokens, stop_ids=()) -> list[Job]:
        """The episode's next turn, within every budget (the client's ``max_tokens`` can
        only shorten it): one job, or none once a budget is spent (an empty reply). Its
        top log-probs are the client's ``top_logprobs`` (under the trainer's temperature);
        its prompt log-probs the client's ``prompt_logprobs`` (the segment's tokens so far
        scored, as on the plain route)."""
        rec, s = self.rec, self.rec.settings
        ep, sampling = rec.episode, s.sampling
        self.max_tokens = asked.max_tokens
        full = ep.prompt_ids + ep.completion_ids
        if (
            not ep.finish_reason
            and sampling.max_turns is not None
            and ep.num_turns >= sampling.max_turns
        ):
            ep.finish_reason = "max_turns"
        limit = min(
            sampling.max_tokens_per_turn or sampling.max_new_tokens,
            sampling.max_new_tokens - len(ep.completion_ids),
            self.engine.max_pos - len(full),
        )
        if asked.max_tokens is not None:
            limit = min(limit, asked.max_tokens)
        if not ep.finish_reason and limit <= 0:
            ep.finish_reason = "length"
        if ep.finish_reason:  # a budget is spent: an empty reply, nothing sampled
            return []
        job = Job(
            full,
            limit,
            sampling,
            seed=s.seed,
            key=mix_key(s.key, rec.turns),
            session=rec.eid,
            stop_ids=tuple(stop_ids),
            top_logprobs=asked.top_logprobs if self.top else 0,
            prompt_logprobs=asked.prompt_logprobs,
        )
        rec.turns += 1
        return [job]

    async def sample(self, handler: Handler, jobs: list[Job]) -> list[Sampled]:
        """The turn sampled and appended to the episode (loss mask 1), and the episode ended
        if a budget cut it; an empty reply when there is no turn to sample."""
        if not jobs:
            return [Sampled([], [], "", "length")]
        (sampled,) = await handler.sample(jobs)
        rec, ep = self.rec, self.rec.episode
        ep.completion_ids += sampled.token_ids
        ep.loss_mask += [1] * len(sampled.token_ids)
        ep.logprobs += sampled.logprobs
        ep.sampler_logprobs += sampled.sampler_logprobs or sampled.logprobs
        ep.num_turns += 1
        rec.last_end = sampled.finish
        if sampled.finish == "length":
            tight = (
                len(ep.completion_ids) >= rec.settings.sampling.max_new_tokens
                or len(ep.prompt_ids) + len(ep.completion_ids) >= self.engine.max_pos
            )
            # the client's own max_tokens cut it: the episode may go on (after the
            # template's end-of-turn token, as after a stop string)
            mt = self.max_tokens
            if tight or mt is None or len(sampled.token_ids) < mt:
                ep.finish_reason = "length" if tight else "turn_length"
        return [sampled]

    def replied(self, sampled: Sampled, chat: dict | None) -> None:
        """The reply kept in the record's conversation: a chat reply's message as the
        template renders it (``chat``: its choice's parts), else the text."""
        if not sampled.token_ids:
            return
        rec, ep = self.rec, self.rec.episode
        if chat is not None:
            msg = chat["template"]
            rec.messages.append(msg)
            ep.messages.append(msg)
            ep.tool_calls += len(msg.get("tool_calls") or [])
            ep.tool_failures += len(chat["tool_errors"])
            return
        ep.messages.append({"role": "assistant", "content": sampled.text})
        if rec.kind == "text":
            rec.text += self.engine.tokenizer.decode(sampled.token_ids, skip_special_tokens=True)
