"""An OpenAI-compatible HTTP endpoint in front of the policy: ``peergrade serve`` and the
trainer's own server for harness training.

``build_app(engine)`` is a Starlette app (served by uvicorn) speaking the parts of the OpenAI API
that agents use, as vLLM speaks them:

- ``GET /v1/models``;
- ``POST /v1/chat/completions``: ``messages``, ``tools`` (rendered by the model's chat template;
  Hermes/Qwen2 ``<tool_call>`` blocks in the reply, or Llama 3 JSON calls when the template
  writes those (``Engine.tool_format``), are parsed with ``envs.tools.parse_tool_calls``
  into ``message.tool_calls``, finish_reason ``tool_calls``), ``tool_choice`` (``auto``,
  ``none``, ``required``, a named function), ``n``, ``temperature`` (0 =
  greedy), ``top_p``, ``top_k`` (vLLM's extra), ``max_tokens`` / ``max_completion_tokens``,
  ``stop``, ``seed``, ``logprobs`` / ``top_logprobs``, ``stream`` (server-sent events);
- ``POST /v1/completions`` for plain prompts (a string or token ids, or a batch of them);
- ``POST /v1/responses``: OpenAI's Responses API (``input`` items, ``instructions``,
  ``previous_response_id``, function ``tools``, ``stream``), translated to the chat request it
  means and back (``serving.responses``); ``GET`` / ``DELETE /v1/responses/{id}``;
- vLLM's ``return_token_ids: true``: ``prompt_token_ids`` and ``choices[i].token_ids``;
- vLLM's ``prompt_logprobs: k``: each prompt token's log-prob and rank, with the ``k`` most
  likely tokens beside it (``prompt_logprobs``), on the chat, text and token routes;
- ``POST /v1/episodes/<id>/<key>/chat/completions`` (and ``.../responses``,
  ``.../completions``, ``.../models``): the same API under a base URL private to one training
  episode (``serving.recorder``; a wrong ``<key>`` is a 404 and changes nothing).

Requests are queued to one worker thread (``Engine``) that owns the model: it takes everything
queued (after a short collection window) and answers it with as few ``kernel.generate`` calls
as the requests' sampling settings allow (one per distinct temperature / top-p / top-k / stop /
seed), so concurrent agents share batched forward passes instead of queueing one by one.
Each request is answered as soon as its rows end (EOS, a stop string or its own
``max_tokens``: a row leaves the batch there), not when the call's longest row does.

Bad requests get OpenAI's error shape (``{"error": {"message", "type", "param", "code"}}``) with
HTTP 400: an unknown model, malformed messages, a chat template that fails to render them (or
the tools), a prompt that does not fit the context.

Why Starlette + uvicorn: the ASGI pair vLLM's and SGLang's servers sit on (through FastAPI,
which adds only schema generation on top of Starlette), small (no pydantic models to keep in
step with the OpenAI schema), maintained by Encode for years, with streaming responses built in
and a ``uvicorn.Server`` that can run on a thread inside the trainer on an ephemeral port.

Streams (``serving.stream``) are sent as the tokens are sampled; a chat request with
``logprobs`` and a training episode's request are streamed once their reply is finished.

``tool_choice`` ``required`` or a named function starts the reply with the template's own
start of a call (``forced_prefix``), which the model continues.
Fields it cannot honour (``response_format``, penalties, ``logit_bias``,
vLLM's ``guided_*``, ``min_p``, ``ignore_eos`` and the like: ``openai_schema._UNSUPPORTED``)
are refused with a 400 naming them (``refuse_unsupported``), not ignored. vLLM's
``chat_template_kwargs`` are passed to the chat template.

Robustness: a body over ``max_body_bytes`` is a 413, slow headers or bodies a 408
(``timed_protocol``), a client that disconnects cancels its sampling call once nobody else
waits for it (``_unless_gone``, ``_Gone``), prompts are tokenised off the event loop, and
admission control (``Engine.max_batch_tokens``) keeps each batch within a memory budget
counted in KV cache slots (``Engine.cost``: the cache, the sampler's buffers and the
prefill's activations; ``default_batch_tokens``), refusing at once what can never fit. ``api_key``: vLLM's
``--api-key``.

On vLLM (``Engine(vllm=VllmEngine)``: ``peergrade serve --engine vllm``, harness training
with ``rollout.engine vllm``) the worker drives vLLM's engine step by step instead
(``Engine._vllm_loop``, ``vllm_engine.StepDriver``): continuous batching, a request joins the
running batch at the next step, each job seeded by (seed, key) as the kernel seeds it; top and
prompt log-probs still come from the model's own forward. Training episodes keep no KV rows
(``keep_sessions``): vLLM's prefix cache serves their shared history.

What it does not do: per-user keys, continuous batching inside a running own-kernel
``generate`` call (requests that arrive during one wait for the next: docs/serving.md says
why), images, audio, the Responses API's built-in tools and background mode, constrained
decoding.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import queue
import secrets
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from peergrade.envs.template import render, renders_tools, template_name, tool_names
from peergrade.envs.tools import parse_tool_calls
from peergrade.generation.kernel import (
    SAMPLER_VOCAB_BUFFERS,
    GenerationCancelled,
    Hooks,
    check_cancel,
    cut_after_stop,
    default_eos_ids,
    eval_mode,
    generate,
    model_kv_bytes_per_token,
)
from peergrade.generation.record import SamplerSettings
from peergrade.model.logprobs import PositionScores, position_logprobs
from peergrade.serving.openai_schema import (
    APIError,
    Settings,
    TokenRequest,
    canonical,
    check_tools,
    normalise_messages,
    offered_tools,
    parse_generate,
    parse_prompts,
    parse_settings,
    refuse_unsupported,
)
from peergrade.serving.responses import ResponseStore, answer
from peergrade.serving.stream import (
    live_chat,
    live_completion,
    replay_chat,
    usage_of,
    whole_completion,
)

#: re-exported: the request checks the recorder shares (``openai_schema``)
__all__ = [
    "APIError",
    "Engine",
    "Job",
    "Limits",
    "Server",
    "Settings",
    "build_app",
    "canonical",
    "check_tools",
    "normalise_messages",
    "parse_settings",
    "serve",
]


# ----------------------------------------------------------------------------- the engine


def _resolve(fut: concurrent.futures.Future, result=None, error=None) -> None:
    """Answer ``fut`` unless it already is (answered early, or cancelled by its waiter)."""
    if fut.done():
        return
    with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled meanwhile
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)


def mix_key(*parts: int) -> int:
    """A key in [0, 2**63) from ints (splitmix64 over them): row keys of the keyed sampler."""
    z = 0x9E3779B97F4A7C15
    for p in parts:
        z = (z ^ (int(p) & (2**64 - 1))) & (2**64 - 1)
        z = (z + 0x9E3779B97F4A7C15) & (2**64 - 1)
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
        z ^= z >> 31
    return z & (2**63 - 1)


@dataclass
class Job:
    """One completion to sample: a prompt in tokens and its sampling settings. The draws are
    keyed by (``seed``, ``key``) only, so a job samples the same tokens whatever else shares
    its batch."""

    prompt_ids: list[int]
    max_tokens: int
    #: temperature, top-p, top-k and stop strings (its ``n`` and ``max_new_tokens`` are not
    #: read: a job is one sequence, ``max_tokens`` its budget)
    sampling: SamplerSettings = field(default_factory=lambda: SamplerSettings(1, 1))
    seed: int = 0
    key: int = 0
    top_logprobs: int = 0  # > 0: the top tokens' log-probs at every position
    #: not None: the prompt's tokens' log-probs too (``echo``), with this many top tokens each
    prompt_logprobs: int | None = None
    session: str | None = None  # a training episode: its KV cache row is kept (``sessions``)
    stop_ids: tuple[int, ...] = ()  # tokens that end the reply besides the model's eos
    #: called on the engine's thread with each counted token as it is sampled (a live stream)
    on_token: Callable[[int], None] | None = field(default=None, repr=False, compare=False)

    def group(self) -> tuple:
        s = self.sampling
        return (s.temperature, s.top_p, s.top_k, s.stop, self.seed, self.stop_ids)


@dataclass
class Sampled:
    """What a job sampled: the counted tokens, their log-probs (full tempered distribution,
    untempered when greedy: ``Samples.logprobs``; ``sampler_logprobs``: under the truncated
    distribution actually drawn from), the decoded text (stop string kept),
    why it ended (``eos`` | ``stop`` | ``length``) and, when asked, the top log-probs."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish: str
    top: list[list[tuple[int, float]]] | None = None
    sampler_logprobs: list[float] | None = None  # the distribution drawn from (top-k/top-p)
    #: the prompt's tokens after the first: their log-probs, top tokens and ranks
    #: (``Job.prompt_logprobs``)
    prompt: PositionScores | None = None


class Engine:
    """The model behind the endpoint: one worker thread runs every ``generate`` call, batching
    the jobs queued at that moment (after ``window_s``) into as few calls as their settings allow.

    ``submit(jobs)`` returns a ``concurrent.futures.Future`` of their ``Sampled`` results,
    resolved as soon as their rows end, while the call's longer rows go on (each row to its own
    ``max_tokens``), so a short request does not wait for a long one and a training episode's
    agent works meanwhile.
    The model object is used as it is (the trainer's policy: its current weights)."""

    def __init__(
        self,
        model,
        tokenizer,
        name: str,
        *,
        window_s: float = 0.005,
        max_batch: int = 256,
        chat_template: str | None = None,
        max_batch_tokens: int | None = None,
        vllm=None,
    ):
        self.model, self.tokenizer, self.name = model, tokenizer, name
        #: a ``generation.vllm_engine.VllmEngine``: sample with it, continuously batched
        #: (``_vllm_loop``); None: the own kernel
        self.vllm = vllm
        self.window_s, self.max_batch = window_s, max_batch
        #: admission control: the KV cache slots one batch may take (``cost``); requests past
        #: it wait for the next batch, and one that cannot fit alone is refused
        #: (``check_fits``). None: no limit (the trainer's endpoint: its batch is its step)
        self.max_batch_tokens = max_batch_tokens
        self.row_tokens = row_overhead_tokens(model)
        self._prefill = prefill_bytes(model)  # (per prompt token, per token pair), bytes
        self._kv_bytes = kv_bytes_per_token(model)
        self._carry = None  # a request taken from the queue but left for the next batch
        self.chat_template = chat_template
        from peergrade.model.chat_templates import tool_format

        #: the call format replies are parsed in: the one the chat template writes
        #: (``model.chat_templates.tool_format``: Hermes ``<tool_call>`` or Llama 3 JSON)
        self.tool_format = tool_format(chat_template or getattr(tokenizer, "chat_template", None))
        #: a request's ``tools`` that the chat template does not show the model (``tools_seen``):
        #: ``warn`` (``peergrade serve``: a line in the log, once per tool set), ``error`` (a
        #: training endpoint: a 400, unless ``env.unrendered_tools``) or ``allow``
        self.unseen_tools = "warn"
        self.tools_shown: dict[str, bool] = {}
        self.prompts: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # ``render_prompt``'s
        self.prompts_lock = threading.Lock()
        self.forced: dict[str, tuple[str, list[int]]] = {}  # ``forced_prefix``'s
        self.eos_ids = default_eos_ids(model, tokenizer)
        cfg = model.config
        self.max_pos = int(getattr(cfg, "max_position_embeddings", None) or 10**9)
        self.created = int(time.time())
        self._q: queue.Queue = queue.Queue()
        #: how many requests can arrive before the next batch at most (the trainer's open
        #: episodes: each has one request in flight at a time); None = unknown
        self.expected = None
        self.busy_s = 0.0  # seconds spent sampling
        self.sessions = None  # training episodes' KV cache rows (``keep_sessions``)
        self.calls = 0  # generate calls made
        self.jobs = 0  # jobs answered
        self.cancelled = 0  # calls stopped because every client of theirs had left
        self._taken = 0  # requests the worker holds while ``hold`` is on
        self._go = threading.Event()  # cleared: the worker holds queued requests (``hold``)
        self._go.set()
        #: set: the call in flight stops at its next step and new requests fail at once
        #: (``interrupt``), until ``resume``
        self._cancel = threading.Event()
        self._busy = False  # the worker is inside a call
        loop = self._loop if vllm is None else self._vllm_loop
        self._thread = threading.Thread(target=loop, name="peergrade-engine", daemon=True)
        self._thread.start()

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text (a completion prompt, fed text): no special tokens added."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def keep_sessions(self) -> None:
        """Keep each training episode's KV cache between its requests (``sessions``), when
        the model's attention allows it (full attention, sdpa or eager)."""
        from peergrade.generation.kernel import slab_cache_ok
        from peergrade.generation.sessions import Sessions

        if self.vllm is None and slab_cache_ok(self.model.config):  # vLLM: its prefix cache
            self.sessions = Sessions(self.model, self.tokenizer, self.eos_ids, self.max_pos)
            self.sessions.cancel = self._cancel

    def hold(self) -> None:
        """Keep queued requests waiting until ``release`` (then they form one batch)."""
        self._go.clear()

    def release(self) -> None:
        self._go.set()

    def queued(self) -> int:
        """Requests waiting for the worker."""
        return self._q.qsize() + self._taken + (self._carry is not None)

    def prefill_slots(self, prompt_len: int) -> int:
        """One row's prefill of ``prompt_len`` tokens in KV cache slots: the memory its
        forward pass holds for a moment (``prefill_bytes``), beside the cache it fills."""
        per_token, per_pair = self._prefill
        need = per_token * prompt_len + per_pair * prompt_len * prompt_len
        return -(-need // self._kv_bytes)

    def cost(self, jobs: Sequence[Job]) -> int:
        """The memory ``jobs`` take in one sampling call, in KV cache token slots, as the
        kernel allocates it: each row holds the longest prompt plus the longest budget, the
        sampler's per-row buffers (``row_tokens``) and, while the prompts are prefilled (all
        rows at once, padded to the longest), that forward pass's activations
        (``prefill_slots``)."""
        if not jobs:
            return 0
        longest = max(len(j.prompt_ids) for j in jobs)
        span = longest + max(j.max_tokens for j in jobs)
        return len(jobs) * (span + self.row_tokens + self.prefill_slots(longest))

    def check_fits(self, jobs: Sequence[Job], param: str = "n") -> None:
        """A 400 for a request that can never be admitted: it alone needs more KV cache
        slots than ``max_batch_tokens``."""
        need = self.cost(jobs)
        if self.max_batch_tokens is not None and need > self.max_batch_tokens:
            longest = max(len(j.prompt_ids) for j in jobs)
            raise APIError(
                f"this request needs {need} KV cache token slots ({len(jobs)} sequence(s) of "
                f"prompt + max_tokens, plus {self.row_tokens} each for the sampler and "
                f"{self.prefill_slots(longest)} each for the prompt's prefill), more than "
                f"the server's limit of {self.max_batch_tokens} (max_batch_tokens: peergrade "
                "serve --max-batch-tokens); lower n, max_tokens or the prompt's length",
                param=param,
                code="request_too_large",
            )

    def submit(self, jobs: Sequence[Job]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._cancel.is_set():
            fut.set_exception(GenerationCancelled())
        else:
            self._q.put((list(jobs), fut))
        return fut

    def interrupt(self, wait_s: float = 60.0) -> bool:
        """Stop the sampling call in flight at its next step (its requests fail with
        ``GenerationCancelled``, as do new ones until ``resume``) and wait up to ``wait_s``
        until the worker is idle; True if it is. A run that stops (Ctrl-C, an error) calls
        this so that no thread is inside the model when the interpreter exits (torch aborts
        the process then: "terminate called without an active exception")."""
        self._cancel.set()
        self._go.set()
        deadline = time.monotonic() + wait_s
        while (
            self._thread.is_alive()
            and (self._busy or not self._q.empty() or self._carry is not None)
            and time.monotonic() < deadline
        ):
            time.sleep(0.005)
        return not self._busy or not self._thread.is_alive()

    def resume(self) -> None:
        """Serve again after ``interrupt``."""
        self._cancel.clear()

    def close(self) -> None:
        self._q.put(None)

    def _loop(self) -> None:
        while True:
            self._go.wait()
            item, self._carry = (self._q.get() if self._carry is None else self._carry), None
            if item is None:
                return
            if item[1].done():  # cancelled while queued: its client left
                continue
            self._busy = True  # until this batch is answered (``interrupt`` waits for it)
            self._taken = 1
            self._go.wait()
            self._taken = 0
            batch = [item]
            # Collect more: each next request may arrive within window_s of the last one; stop
            # early once every client that can send (``expected``) has sent, or at the first
            # one that would take the batch past ``max_batch_tokens`` (it opens the next).
            while (size := sum(len(j) for j, _ in batch)) < self.max_batch:
                if self.expected is not None and size >= self.expected():
                    break
                try:
                    nxt = (
                        self._q.get(timeout=self.window_s)
                        if self.window_s > 0
                        else (self._q.get_nowait())
                    )
                except queue.Empty:
                    break
                if nxt is None:
                    self._q.put(None)
                    break
                if nxt[1].done():
                    continue
                if self.max_batch_tokens is not None and (
                    self.cost([j for jobs, _ in batch for j in jobs] + nxt[0])
                    > self.max_batch_tokens
                ):
                    self._carry = nxt
                    break
                batch.append(nxt)
            t0 = time.perf_counter()
            try:
                self._run(batch)
            finally:
                self._busy = False
            self.busy_s += time.perf_counter() - t0

    def _run(self, batch: list[tuple[list[Job], concurrent.futures.Future]]) -> None:
        flat = [(bi, ji, job) for bi, (jobs, _) in enumerate(batch) for ji, job in enumerate(jobs)]
        results: dict[tuple[int, int], Any] = {}

        def answer(bi: int) -> None:  # request ``bi``, once all its jobs have their results
            jobs, fut = batch[bi]
            if all((bi, ji) in results for ji in range(len(jobs))):
                _resolve(fut, [results[(bi, ji)] for ji in range(len(jobs))])

        try:
            check_cancel(self._cancel)
            groups: dict[tuple, list] = {}
            for item in flat:
                groups.setdefault(item[2].group(), []).append(item)
            for items in groups.values():
                kept = [it for it in items if it[2].session is not None and self.sessions]
                if kept:

                    def done(k: int, res: Sampled, kept=kept) -> None:
                        # a row that ended is answered at once, while longer rows go on
                        bi, ji, _ = kept[k]
                        results[(bi, ji)] = res
                        answer(bi)

                    self._session_run([j for *_, j in kept], done)
                    items = [it for it in items if it not in kept]
                for bi, ji, job in [it for it in items if it[2].max_tokens == 0]:
                    results[(bi, ji)] = self._scored_only(job)  # echo: the prompt alone
                items = [it for it in items if it[2].max_tokens > 0]
                for part in _split_calls(items, self.max_pos):

                    def ended(k: int, res: Sampled, part=part) -> None:
                        bi, ji, _ = part[k]  # answered as soon as its row ends, as above
                        results[(bi, ji)] = res
                        answer(bi)

                    gone = _Gone(self._cancel, [batch[bi][1] for bi, _, _ in part])
                    if gone.is_set():  # every client of this call left while it was queued
                        continue
                    try:
                        self._generate([j for _, _, j in part], ended, gone)
                    except GenerationCancelled:
                        if self._cancel.is_set():
                            raise
                        self.cancelled += 1  # its clients left: the next call goes on
        except BaseException as e:  # every waiting request learns of it; the thread goes on
            for _, fut in batch:
                _resolve(fut, error=e)
            return
        for bi in range(len(batch)):
            answer(bi)

    # ------------------------------------------------------------- on vLLM: continuous batching

    def _vllm_loop(self) -> None:
        """The worker on vLLM (``vllm``), driving its engine one step at a time
        (``vllm_engine.StepDriver``): the requests queued since the last step join the running
        batch, each job's new tokens reach its stream, a request is answered as soon as its
        jobs end, and the jobs of a request whose client left (or of all, on ``interrupt``)
        are aborted."""
        from peergrade.generation.vllm_engine import StepDriver

        driver = StepDriver(self.vllm, self.model, self.tokenizer)
        live: dict[str, tuple[list, int]] = {}  # request id -> ([jobs, future, results], job)
        ids = iter(range(1, 2**62))
        while True:
            items = self._vllm_take(block=not live)
            try:
                if items is None or self._cancel.is_set():  # closed, or interrupted
                    error = GenerationCancelled()
                    futures = [r[1] for r, _ in live.values()] + [f for _, f in items or ()]
                    for fut in futures:
                        _resolve(fut, error=error)
                    driver.abort(list(live))
                    live.clear()
                    if items is None:
                        return
                    continue
                for jobs, fut in items:
                    self._vllm_add(driver, live, [jobs, fut, [None] * len(jobs)], ids)
                gone = [rid for rid, (req, _) in live.items() if req[1].done()]
                if gone:  # their clients left
                    self.cancelled += len({id(live[rid][0]) for rid in gone})
                    driver.abort(gone)
                    for rid in gone:
                        del live[rid]
                if live:
                    t0 = time.perf_counter()
                    self.calls += 1
                    for rid, toks, lps, finish in driver.step():
                        self._vllm_took(live, rid, toks, lps, finish)
                    self.busy_s += time.perf_counter() - t0
            except BaseException as e:  # every waiting request learns of it; the thread goes on
                for req, _ in live.values():
                    _resolve(req[1], error=e)
                with contextlib.suppress(Exception):
                    driver.abort(list(live))
                live.clear()
            self._busy = bool(live)

    def _vllm_add(self, driver, live: dict, req: list, ids) -> None:
        """Request ``req`` (``[jobs, future, results]``) into vLLM's batch, one vLLM request
        per job (``ids`` numbers them); one that vLLM refuses fails alone."""
        jobs, fut, results = req
        self.jobs += len(jobs)
        added = []
        try:
            for ji, job in enumerate(jobs):
                if job.max_tokens == 0:
                    results[ji] = self._scored_only(job)  # echo: the prompt alone
                    continue
                rid = str(next(ids))
                eos = sorted({*self.eos_ids, *job.stop_ids})
                driver.add(
                    rid,
                    job.prompt_ids,
                    job.sampling,
                    job.max_tokens,
                    seed=job.seed,
                    key=job.key,
                    eos=eos,
                )
                added.append(rid)
                live[rid] = (req, ji)
        except Exception as e:
            driver.abort(added)
            for rid in added:
                del live[rid]
            _resolve(fut, error=e)
            return
        _vllm_answer(req)

    def _vllm_take(self, block: bool) -> list | None:
        """The requests queued now (waiting for one when ``block``; held while ``hold`` is
        on), without those whose client already left; None once closed."""
        items = []
        if block:
            self._busy = False
            self._go.wait()
            first = self._q.get()
            if first is None:
                return None
            items.append(first)
            self._busy = True
            self._go.wait()
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return None
            items.append(item)
        return [it for it in items if not it[1].done()]

    def _vllm_took(self, live: dict, rid: str, toks, lps, finish: str | None) -> None:
        """Job ``rid``'s new tokens ``toks`` (log-probs ``lps``): to its stream, and, once it
        ended (``finish``), its ``Sampled`` (the request answered when its jobs all are)."""
        req, ji = live[rid]
        job = req[0][ji]
        if job.on_token is not None:
            for t in toks:
                job.on_token(t)
        got = req[2][ji] = req[2][ji] or ([], [])
        got[0].extend(toks)
        got[1].extend(lps)
        if finish is None:
            return
        del live[rid]
        ids, lp = got
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if finish == "stop":
            text = cut_after_stop(text, job.sampling.stop)
        greedy = job.sampling.temperature == 0
        slps = [0.0] * len(lp) if greedy else list(lp)  # as ``VllmEngine.sample`` records them
        req[2][ji] = self._sampled(job, ids, lp, slps, text, finish)
        _vllm_answer(req)

    def forget(self, session: str) -> None:
        """The episode ``session`` is over: its KV cache row can go."""
        if self.sessions:
            self.sessions.forget(session)

    def _session_run(self, jobs: list[Job], done: Callable[[int, Sampled], None]) -> None:
        """Sample ``jobs`` (training episodes) on their kept caches; ``done(i, sampled)`` as
        each job's row ends."""
        self.calls += 1
        self.jobs += len(jobs)

        def ended(i: int, res: tuple) -> None:
            j, (ids, lps, slps, finish) = jobs[i], res
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            if finish == "stop":
                text = cut_after_stop(text, j.sampling.stop)
            done(i, self._sampled(j, ids, lps, slps, text, finish))

        self.sessions.run(jobs, ended)

    def _generate(self, jobs: list[Job], done: Callable[[int, Sampled], None], cancel=None) -> None:
        """Sample ``jobs`` (one settings group) in one ``generate`` call, each job to its own
        ``max_tokens``; ``done(i, sampled)`` as each job's row ends."""
        j0 = jobs[0]

        def hand_on(seqs: list[int], tokens: list[int]) -> None:
            for q, t in zip(seqs, tokens):  # counted tokens only: none past a row's budget
                if jobs[q].on_token is not None:
                    jobs[q].on_token(t)

        def ended(q: int, row: dict) -> None:
            done(
                q,
                self._sampled(
                    jobs[q],
                    row["tokens"],
                    row["logprobs"],
                    row["sampler_logprobs"],
                    row["text"],
                    row["finish"],
                ),
            )

        self.calls += 1
        self.jobs += len(jobs)
        live = hand_on if any(j.on_token is not None for j in jobs) else None
        generate(
            self.model,
            self.tokenizer,
            [j.prompt_ids for j in jobs],
            j0.sampling.replace(
                n=1,
                max_new_tokens=max(j.max_tokens for j in jobs),
                batch_size=None,
                ignore_eos=False,
            ),
            seed=j0.seed,
            row_keys=[j.key for j in jobs],
            eos_token_ids=sorted({*self.eos_ids, *j0.stop_ids}),
            budgets=[j.max_tokens for j in jobs],
            hooks=Hooks(live, ended, self._cancel if cancel is None else cancel),
        )

    def _scored_only(self, job: Job) -> Sampled:
        """A job with nothing to sample (``max_tokens`` 0, ``echo``): its prompt's scores."""
        self.jobs += 1
        return self._sampled(job, [], [], [], "", "length")

    def _sampled(self, job: Job, ids, lps, slps, text: str, finish: str) -> Sampled:
        """A finished job's ``Sampled``, with the top and prompt log-probs it asked for."""
        s = Sampled(ids, lps, text, finish, sampler_logprobs=slps)
        if job.top_logprobs > 0 and ids:
            s.top = self._top_logprobs(job, ids)
        if job.prompt_logprobs is not None:
            s.prompt = self._prompt_logprobs(job)
        return s

    def _top_logprobs(self, job: Job, ids: list[int]) -> list[list[tuple[int, float]]]:
        """The ``top_logprobs`` most likely tokens at each sampled position (at the job's
        temperature; untempered when greedy)."""
        with eval_mode(self.model):
            return position_logprobs(
                self.model,
                job.prompt_ids + ids,
                len(job.prompt_ids),
                job.top_logprobs,
                job.sampling.temperature,
            ).top

    def _prompt_logprobs(self, job: Job) -> PositionScores:
        """The log-prob and rank of each prompt token after the first, and its
        ``prompt_logprobs`` top tokens, under the model's own distribution (temperature 1), as
        vLLM's prompt log-probs and OpenAI's ``echo`` give them."""
        if len(job.prompt_ids) < 2:
            return PositionScores([], [] if job.prompt_logprobs else None, [])
        with eval_mode(self.model):
            return position_logprobs(self.model, job.prompt_ids, 1, job.prompt_logprobs)


def kv_bytes_per_token(model) -> int:
    """Bytes of KV cache one token of one sequence takes (``kernel.model_kv_bytes_per_token``:
    the memory planner's formula)."""
    return model_kv_bytes_per_token(model)


def row_overhead_tokens(model) -> int:
    """The sampler's per-row buffers (``kernel.SAMPLER_VOCAB_BUFFERS`` float32 rows of the
    vocabulary) in KV cache token slots, so that a request's cost is one number."""
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    return -(-(SAMPLER_VOCAB_BUFFERS * vocab * 4) // kv_bytes_per_token(model))


def prefill_bytes(model) -> tuple[int, int]:
    """The memory a prompt's prefill holds for a moment besides its KV cache, as (bytes per
    prompt token, bytes per pair of prompt tokens): one layer's activations at a time (no
    gradients are kept), its hidden states (4 of ``hidden_size``) and its MLP's
    intermediates (3 of ``intermediate_size``) per token in the model's dtype, and, where the
    attention materialises its scores (eager attention, and sdpa on the CPU under the
    kernel's padding mask, as measured), a float32 score per head and token pair plus the
    mask's byte. Measured on the bundled tiny-calc (sdpa, CPU): a prefill of 64 rows of 420
    tokens raised the peak resident memory by 403 MiB; this formula gives 6.3 MB a row,
    400 MiB. Not counted: sdpa's and flash attention's kernels on a GPU keep no scores."""
    cfg = getattr(model.config, "text_config", None) or model.config
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    inter = int(getattr(cfg, "intermediate_size", 0) or 4 * hidden)
    heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    size = param.element_size() if param is not None else 4
    attn = getattr(cfg, "_attn_implementation", None) or "eager"
    on_cpu = param is None or param.device.type == "cpu"
    scores = attn == "eager" or (attn == "sdpa" and on_cpu)
    return (4 * hidden + 3 * inter) * size, heads * 4 + 1 if scores else 0


def default_batch_tokens(model, max_pos: int, memory_bytes: int | None = None) -> int:
    """``max_batch_tokens`` from the memory sampling may use (the KV cache, the sampler's
    buffers, the prefill's activations: ``Engine.cost``): ``memory_bytes``, else 80% of the
    GPU's free memory (the model on a GPU) or half the machine's available memory (on the
    CPU); at least one full-context sequence with its prefill."""
    if memory_bytes is None:
        memory_bytes = _free_memory(next(model.parameters()).device)
    per_token = kv_bytes_per_token(model)
    per_tok, per_pair = prefill_bytes(model)
    one = max_pos + row_overhead_tokens(model)
    one += -(-(per_tok * max_pos + per_pair * max_pos * max_pos) // per_token)
    return max(int(memory_bytes // per_token), one)


def _free_memory(device) -> int:
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024 // 2
    except (OSError, KeyError, ValueError):
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")) // 2


def _vllm_answer(req: list) -> None:
    """Answer a request on vLLM (``[jobs, future, results]``) once every job has its
    ``Sampled``."""
    if all(isinstance(r, Sampled) for r in req[2]):
        _resolve(req[1], req[2])


class _Gone:
    """The cancel event of one ``generate`` call (``kernel.check_cancel`` reads ``is_set``):
    set when the engine is interrupted, or when no request of the call is still waiting, i.e.
    each was answered or cancelled by its waiter (``Future.cancel``: the client disconnected),
    so a call nobody waits for stops at its next token instead of running to its budget; and
    ``dropped``, the rows of a call that others still wait for whose client left."""

    def __init__(self, engine_cancel: threading.Event, futures: list):
        self.engine_cancel, self.futures = engine_cancel, futures  # futures[k]: job k's request

    def is_set(self) -> bool:
        return self.engine_cancel.is_set() or all(f.done() for f in self.futures)

    def dropped(self) -> set[int]:
        """The call's rows whose request is cancelled (or answered): they leave the batch at
        the kernel's next check while the others go on."""
        return {k for k, f in enumerate(self.futures) if f.done()}


def _split_calls(items: list, max_pos: int) -> list[list]:
    """Items of one settings group as ``generate`` calls: keys distinct within a call, and
    every prompt fits the context with the call's longest budget."""
    calls: list[list] = []
    for item in sorted(items, key=lambda it: -it[2].max_tokens):
        job = item[2]
        for call in calls:
            T = call[0][2].max_tokens  # sorted: the first is the longest budget
            if len(job.prompt_ids) + T <= max_pos and all(c[2].key != job.key for c in call):
                call.append(item)
                break
        else:
            calls.append([item])
    return calls


# ----------------------------------------------------------------------------- requests


def render_prompt(
    engine: Engine,
    messages: list[dict],
    tools: list[dict] | None,
    template_kwargs: dict | None = None,
) -> list[int]:
    """The prompt's token ids: the chat template's rendering of ``messages`` (and ``tools``,
    and the request's ``chat_template_kwargs``) with the generation prompt. Kept for the last
    256 distinct requests (with the date: some templates print it), so the G samples of a
    prompt, which open with the same request, are rendered once."""
    day = time.strftime("%Y-%m-%d")
    key = json.dumps([messages, tools, template_kwargs, day], sort_keys=True, default=repr)
    with engine.prompts_lock:  # requests render on the tokenising thread, episodes on the loop
        kept = engine.prompts.get(key)
        if kept is not None:
            engine.prompts.move_to_end(key)
            return list(kept)
    try:
        ids = render(
            engine.tokenizer,
            messages,
            add_generation_prompt=True,
            tools=tools,
            chat_template=engine.chat_template,
            template_kwargs=template_kwargs,
        )
    except Exception as e:
        what = "these messages with these tools" if tools else "these messages"
        raise APIError(
            f"the chat template of {engine.name} cannot render {what}: {type(e).__name__}: {e}",
            param="tools" if tools else "messages",
            code="template_error",
        ) from e
    if tools:
        tools_seen(engine, tools, template_kwargs)
    with engine.prompts_lock:
        engine.prompts[key] = tuple(ids)
        if len(engine.prompts) > 256:
            engine.prompts.popitem(last=False)
    return ids


def tools_seen(engine: Engine, tools: list[dict], template_kwargs: dict | None) -> None:
    """What ``engine.unseen_tools`` says where the chat template does not show ``tools`` to
    the model (a probe conversation rendered with and without them is the same): the model
    would call them only if it learned them before (a warm-up), and a run trained so would
    train on tools it never sees. Checked once per tool set and template variables."""
    if engine.unseen_tools == "allow":
        return
    key = json.dumps([tools, template_kwargs], sort_keys=True, default=repr)
    shown = engine.tools_shown.get(key)
    first = shown is None
    if first:
        kw = dict(chat_template=engine.chat_template, template_kwargs=template_kwargs)
        try:
            shown = renders_tools(engine.tokenizer, tools, **kw)
        except Exception:  # the request rendered: a probe the template rejects proves nothing
            shown = True
        engine.tools_shown[key] = shown
        if len(engine.tools_shown) > 256:
            engine.tools_shown.pop(next(iter(engine.tools_shown)))
    if not shown:
        names = tool_names(tools)
        of = template_name(engine.tokenizer)
        of = engine.name if of in ("", engine.name) else f"{engine.name} ({of})"
        why = (
            f"the chat template of {of} does not render tool schemas: the model never "
            f"sees the tools ({names}) and calls them only if it learned them before (a warm-up)"
        )
        if engine.unseen_tools == "error":
            raise APIError(
                f"{why}; a run trained so trains on tools the model never sees. Use a model "
                "whose chat template renders `tools`, or set env.unrendered_tools: true when "
                "it knows them already (docs/serving.md)",
                param="tools",
                code="template_error",
            )
        if first:
            print(f"warning: {why}; serving such requests anyway", file=sys.stderr, flush=True)


_PROBE_NAMES = ("pgprobefnA", "pgprobefnB")
_PROBE_ARG = "pg_probe_argument"


def forced_prefix(
    engine: Engine, tools: list[dict] | None, settings: Settings
) -> tuple[str, list[int]]:
    """The text a reply starts with when ``tool_choice`` forces a tool call, and its token ids
    (fed after the prompt; ``("", [])`` when nothing is forced): how the chat template begins
    an assistant tool call, up to the function's name
    (``required``: the model picks it) or up to its arguments (a named function). Read from
    the template itself (an assistant turn with a probe call rendered after the generation
    prompt), so the model continues its own format; the reply is parsed as any other. A
    template that does not render calls so, or not in the ``<tool_call>`` format the replies
    are parsed in, is a 400. Kept per (tools, function, template variables)."""
    if settings.tool_choice != "required":
        return "", []
    name = settings.forced_tool
    key = json.dumps([tools, name, settings.template_kwargs], sort_keys=True, default=repr)
    if key in engine.forced:
        return engine.forced[key]
    tok, kw = engine.tokenizer, settings.template_kwargs or {}
    user = [{"role": "user", "content": "probe"}]

    def text(messages, gen: bool) -> str:
        return tok.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=gen,
            tokenize=False,
            chat_template=engine.chat_template,
            **kw,
        )

    def after_prompt(fn: str) -> str:
        call = {"type": "function", "function": {"name": fn, "arguments": {_PROBE_ARG: 1}}}
        turn = {"role": "assistant", "content": "", "tool_calls": [call]}
        gen, full = text(user, True), text(user + [turn], False)
        return full[len(gen) :] if full.startswith(gen) else ""

    try:
        if name is None:
            a, b = (after_prompt(n) for n in _PROBE_NAMES)
            prefix = a[: a.find(_PROBE_NAMES[0])]
            ok = _PROBE_NAMES[0] in a and b.startswith(prefix)
        else:
            a = after_prompt(name)
            prefix = a[: a.rfind("{", 0, a.find(_PROBE_ARG))]
            ok = _PROBE_ARG in a and name in prefix
    except Exception:
        ok = False
    if not ok or not prefix.lstrip().startswith("<tool_call>"):
        raise APIError(
            f"tool_choice cannot force a call with the chat template of {engine.name}: it does "
            "not render an assistant tool call as <tool_call>{...} after its generation "
            "prompt (the format replies are parsed in); use 'auto'",
            param="tool_choice",
            code="unsupported_parameter",
        )
    if len(engine.forced) >= 256:
        engine.forced.clear()
    engine.forced[key] = (prefix, engine.encode(prefix))
    return engine.forced[key]


# ----------------------------------------------------------------------------- responses


def _token_str(tokenizer, tid: int) -> str:
    return tokenizer.decode([tid], skip_special_tokens=False)


def _strip_stop(text: str, finish: str, stop: Sequence[str]) -> str:
    """OpenAI's content leaves the stop string out (the tokens keep it)."""
    if finish != "stop":
        return text
    cuts = [text.find(x) for x in stop if x in text]
    return text[: min(cuts)] if cuts else text


def chat_choice(
    engine: Engine, index: int, s: Sampled, settings: Settings, tools
) -> tuple[dict, dict]:
    """(choice, the assistant message in template form) of one sampled reply."""
    content = _strip_stop(s.text, s.finish, settings.stop)
    calls, errors = [], []
    if tools:
        content, calls, errors = parse_tool_calls(content, engine.tool_format)
    finish = "tool_calls" if calls else ("length" if s.finish == "length" else "stop")
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": content if (content or not calls) else None,
    }
    if calls:
        msg["tool_calls"] = [
            {
                "id": "call_" + secrets.token_hex(8),
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": json.dumps(c["function"]["arguments"]),
                },
            }
            for c in calls
        ]
    choice: dict[str, Any] = {
        "index": index,
        "message": msg,
        "finish_reason": finish,
        "logprobs": None,
    }
    if settings.logprobs:
        choice["logprobs"] = {"content": _chat_logprobs(engine, s, settings)}
    if settings.return_token_ids:
        choice["token_ids"] = list(s.token_ids)
    template_msg = {"role": "assistant", "content": content or ""}
    if calls:
        template_msg["tool_calls"] = calls
    return choice, {"template": template_msg, "tool_errors": errors}


def _chat_logprobs(engine: Engine, s: Sampled, settings: Settings) -> list[dict]:
    tok = engine.tokenizer
    out = []
    for i, (t, lp) in enumerate(zip(s.token_ids, s.logprobs)):
        ts = _token_str(tok, t)
        item = {"token": ts, "logprob": lp, "bytes": list(ts.encode()), "top_logprobs": []}
        if s.top is not None:
            item["top_logprobs"] = [
                {
                    "token": _token_str(tok, a),
                    "logprob": b,
                    "bytes": list(_token_str(tok, a).encode()),
                }
                for a, b in s.top[i]
            ]
        out.append(item)
    return out


def completion_choice(
    engine: Engine,
    index: int,
    s: Sampled,
    settings: Settings,
    echo_text: str = "",
    prompt_ids: Sequence[int] = (),
) -> dict:
    """A ``/v1/completions`` choice. With ``echo`` and ``logprobs`` (``s.prompt`` scored) the
    log-probs cover the prompt's tokens first, the first one's ``None``, as OpenAI and vLLM
    give them (lm-eval's log-likelihood requests read them)."""
    text = _strip_stop(s.text, s.finish, settings.stop)
    choice: dict[str, Any] = {
        "index": index,
        "text": echo_text + text,
        "finish_reason": "length" if s.finish == "length" else "stop",
        "logprobs": None,
    }
    if settings.logprobs:
        tok = engine.tokenizer
        name = lambda row: {_token_str(tok, a): b for a, b in row}  # noqa: E731
        ids, lps = list(s.token_ids), list(s.logprobs)
        top = None if s.top is None else [name(row) for row in s.top]
        at = len(echo_text)
        if s.prompt is not None and prompt_ids and settings.echo:
            k, p = settings.top_logprobs, s.prompt
            ids, lps, at = list(prompt_ids) + ids, [None, *p.chosen] + lps, 0
            if k:
                top = [None, *(name(row[:k]) for row in p.top or []), *(top or [])]
        toks = [_token_str(tok, t) for t in ids]
        offsets = []
        for t in toks:
            offsets.append(at)
            at += len(t)
        choice["logprobs"] = {
            "tokens": toks,
            "token_logprobs": lps,
            "top_logprobs": top,
            "text_offset": offsets,
        }
    if settings.return_token_ids:
        choice["token_ids"] = list(s.token_ids)
    if settings.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs(engine, prompt_ids, s, settings)
    return choice


def completion_response(
    engine: Engine,
    model: str,
    settings: Settings,
    prompts: list[list[int]],
    echoes: list[str],
    sampled: list[Sampled],
):
    """``/v1/completions``' answer (a dict, or with ``stream`` its events): choice
    ``p * n + i`` is prompt ``p``'s ``i``-th sample."""
    n = settings.n
    choices = [
        completion_choice(engine, i, s, settings, echoes[i // n], prompts[i // n])
        for i, s in enumerate(sampled)
    ]
    usage = usage_of([t for ids in prompts for t in ids], sampled)
    out = {
        "id": "cmpl-" + secrets.token_hex(12),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
    }
    if settings.return_token_ids and len(prompts) == 1:
        out["prompt_token_ids"] = list(prompts[0])
    elif settings.return_token_ids:  # a batch: each choice its own, as vLLM returns them
        for c in choices:
            c["prompt_token_ids"] = list(prompts[c["index"] // n])
    if settings.stream:  # with logprobs, or a batch: each finished choice in one chunk
        return whole_completion(choices, model, usage if settings.include_usage else None)
    return out


def prompt_logprobs(
    engine: Engine, prompt_ids: Sequence[int], s: Sampled, settings: Settings
) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs``: ``None`` for the first prompt token, then for each one a
    dict by token id (the prompt's token first, then the ``settings.prompt_logprobs`` most
    likely) of ``{"logprob", "rank", "decoded_token"}``; log-probs below -9999 are -9999, as
    vLLM clamps them. ``None`` when the prompt was not scored (a spent episode budget)."""
    p, k = s.prompt, settings.prompt_logprobs or 0
    if p is None:
        return None
    tok = engine.tokenizer

    def entry(lp: float, rank: int, t: int) -> dict:
        return {"logprob": max(lp, -9999.0), "rank": rank, "decoded_token": _token_str(tok, t)}

    out: list[dict | None] = [None]
    for i, (t, lp, rank) in enumerate(zip(list(prompt_ids)[1:], p.chosen, p.ranks)):
        d = {str(t): entry(lp, rank, t)}
        for r, (a, b) in enumerate((p.top[i] if p.top and k else [])[:k]):
            d.setdefault(str(a), entry(b, r + 1, a))
        out.append(d)
    return out


def token_response(engine: Engine, req: TokenRequest, sampled: list[Sampled]) -> dict:
    """``/inference/v1/generate``'s answer, as vLLM gives it: per choice the ``token_ids``,
    ``finish_reason`` (``stop``: an eos, a stop token or string; ``length``) and, when asked,
    ``logprobs.content`` with tokens named ``token_id:<id>`` (vLLM's
    ``return_tokens_as_token_ids``); the prompt's ids and the usage."""

    def name(t: int) -> str:
        return f"token_id:{t}"

    choices = []
    for i, s in enumerate(sampled):
        lps = None
        if req.settings.logprobs:
            tops = s.top or [[] for _ in s.token_ids]
            lps = {
                "content": [
                    {
                        "token": name(t),
                        "logprob": lp,
                        "bytes": None,
                        "top_logprobs": [{"token": name(a), "logprob": b} for a, b in top],
                    }
                    for t, lp, top in zip(s.token_ids, s.logprobs, tops)
                ]
            }
        choices.append(
            {
                "index": i,
                "token_ids": list(s.token_ids),
                "logprobs": lps,
                "finish_reason": "length" if s.finish == "length" else "stop",
            }
        )
    out = {
        "request_id": "gen-" + secrets.token_hex(12),
        "choices": choices,
        "prompt_token_ids": list(req.prompt_ids),
        "usage": usage_of(req.prompt_ids, sampled),
    }
    if req.settings.prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs(engine, req.prompt_ids, sampled[0], req.settings)
    return out


# ----------------------------------------------------------------------------- the app


class Plain:
    """The plain routes' way of answering: the prompt is the request's own (its messages
    rendered, its text encoded, its token ids), the client's sampling settings win (a field
    this server cannot honour is refused), ``n`` samples, streamed live. A training
    episode's way (``recorder.Recorded``) has the same methods."""

    live = True  # streams are sent as the tokens are sampled

    def check(self, asked: Settings) -> None:
        refuse_unsupported(asked)

    def settings(self, asked: Settings) -> Settings:
        """The settings the reply is sampled and shown with: the client's."""
        return asked

    def stored(self, handler: Handler) -> ResponseStore:
        return handler.stored

    async def chat_prompt(self, handler: Handler, messages, tools, asked: Settings):
        """(prompt ids, forced prefix text): the messages rendered with the generation
        prompt, then the start of a forced tool call (``forced_prefix``)."""
        kw = asked.template_kwargs
        prompt_ids = await handler.off_loop(render_prompt, handler.engine, messages, tools, kw)
        prefix, fed = await handler.off_loop(forced_prefix, handler.engine, tools, asked)
        return prompt_ids + fed, prefix

    async def text_prompts(self, handler: Handler, raw) -> list[list[int]]:
        tok = handler.engine.tokenizer
        return await handler.off_loop(parse_prompts, raw, handler.engine.encode, len(tok))

    def token_prompt(self, handler: Handler, ids: list[int]) -> list[int]:
        return ids

    def jobs(self, handler: Handler, prompts, asked: Settings, max_tokens, stop_ids=()):
        """``n`` jobs per prompt, each within the context (``max_tokens`` None: the server's
        default budget), admitted or refused at once (``Engine.check_fits``)."""
        jobs = []
        for ids in prompts:
            jobs += handler.jobs(ids, asked, handler.budget(ids, max_tokens), stop_ids)
        if len(prompts) > 1:
            handler.engine.check_fits(jobs, param="prompt")
        return jobs

    async def sample(self, handler: Handler, jobs: list[Job]) -> list[Sampled]:
        return await handler.sample(jobs)

    def replied(self, sampled: Sampled, chat: dict | None) -> None:
        """Nothing is kept of a plain request."""


class Handler:
    """The endpoint's logic, independent of the HTTP framework (the app calls it)."""

    def __init__(self, engine: Engine, recorder=None, max_tokens: int | None = None):
        self.engine, self.recorder, self.default_max_tokens = engine, recorder, max_tokens
        self.stored = ResponseStore()  # /v1/responses' previous_response_id
        #: where prompts are rendered and tokenised: off the event loop, so that a long prompt
        #: does not stall the other requests (``GET /v1/models`` answers meanwhile); one
        #: thread, so the tokenizer is never used by two requests at once
        self._tokenising = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="peergrade-tokenise"
        )

    async def off_loop(self, fn, *args):
        """``fn(*args)`` on the tokenising thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenising, lambda: fn(*args))

    def check_model(self, body: dict) -> str:
        model = body.get("model")
        if model != self.engine.name:
            raise APIError(
                f"model {model!r} does not exist; this server serves "
                f"{self.engine.name!r} (GET /v1/models)",
                status=400,
                param="model",
                code="model_not_found",
            )
        return model

    def budget(self, prompt_ids: list[int], asked: int | None) -> int:
        room = self.engine.max_pos - len(prompt_ids)
        if room < 1 or (asked is not None and asked > room):
            raise APIError(
                f"this model's maximum context length is {self.engine.max_pos} tokens; the "
                f"prompt has {len(prompt_ids)} tokens"
                + (f" and max_tokens is {asked}" if asked is not None else "")
                + "; shorten the messages or lower max_tokens",
                param="messages",
                code="context_length_exceeded",
            )
        if asked is None:
            asked = room if self.default_max_tokens is None else min(room, self.default_max_tokens)
        return asked

    def jobs(self, prompt_ids, settings: Settings, max_tokens: int, stop_ids=()) -> list[Job]:
        base = secrets.randbits(62) if settings.seed is None else settings.seed
        jobs = [
            Job(
                list(prompt_ids),
                max_tokens,
                settings.sampling,
                seed=0,
                key=mix_key(base, i),
                top_logprobs=settings.top_logprobs,
                stop_ids=tuple(stop_ids),
                # the prompt is scored once, with the first sample
                prompt_logprobs=settings.prompt_logprobs if i == 0 else None,
            )
            for i in range(settings.n)
        ]
        self.engine.check_fits(jobs)
        return jobs

    # ---- the routes: each once, the strategy (``way``) says where the prompt comes from and
    # whose settings win: ``Plain`` (this module) or a training episode's
    # (``recorder.Recorded``)

    async def generate(self, body: dict, way=None) -> dict:
        """vLLM's token-in ``POST /inference/v1/generate``: token ids in, token ids and
        log-probs out (``openai_schema.parse_generate``)."""
        way = way or Plain()
        self.check_model(body)
        req = await self.off_loop(parse_generate, body, len(self.engine.tokenizer))
        way.check(req.settings)
        prompt_ids = way.token_prompt(self, req.prompt_ids)
        asked = 16 if req.settings.max_tokens is None else req.settings.max_tokens  # vLLM's
        jobs = way.jobs(self, [prompt_ids], req.settings, asked, req.stop_ids)
        sampled = await way.sample(self, jobs)
        way.replied(sampled[0], None)
        return token_response(self.engine, req, sampled)

    async def sample(self, jobs: list[Job]) -> list[Sampled]:
        return await asyncio.wrap_future(self.engine.submit(jobs))

    async def chat(self, body: dict, way=None):
        way = way or Plain()
        model = self.check_model(body)
        asked = parse_settings(body, chat=True)
        way.check(asked)
        messages = normalise_messages(body.get("messages"))
        tools = offered_tools(body, asked)  # tool_choice none: no tools rendered
        settings = way.settings(asked)
        prompt_ids, prefix = await way.chat_prompt(self, messages, tools, asked)
        jobs = way.jobs(self, [prompt_ids], asked, asked.max_tokens)
        if way.live and settings.stream and not settings.logprobs and not prefix:
            return live_chat(
                self.engine,
                model,
                settings,
                bool(tools),
                prompt_ids,
                jobs,
                lambda i, s: chat_choice(self.engine, i, s, settings, tools)[0],
            )
        sampled = await way.sample(self, jobs)
        for sm in sampled:  # a forced call's start before the reply (none before an empty one)
            if sm.token_ids:
                sm.text = prefix + sm.text
        response, pairs = self.chat_response(model, settings, tools, prompt_ids, sampled)
        way.replied(sampled[0], pairs[0][1])
        return response

    def chat_response(self, model, settings, tools, prompt_ids, sampled):
        rid, created = "chatcmpl-" + secrets.token_hex(12), int(time.time())
        pairs = [chat_choice(self.engine, i, s, settings, tools) for i, s in enumerate(sampled)]
        choices = [c for c, _ in pairs]
        if settings.stream:
            return replay_chat(
                self.engine, rid, created, model, choices, sampled, settings, prompt_ids
            ), pairs
        out = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage_of(prompt_ids, sampled),
        }
        if settings.return_token_ids:
            out["prompt_token_ids"] = list(prompt_ids)
        if settings.prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_logprobs(self.engine, prompt_ids, sampled[0], settings)
        return out, pairs

    async def responses(self, body: dict, way=None):
        """OpenAI's Responses API, answered through the chat route (``serving.responses``),
        with the way's store of earlier responses (``previous_response_id``)."""
        way = way or Plain()
        return await answer(body, way.stored(self), lambda b: self.chat(b, way))

    async def completions(self, body: dict, way=None):
        way = way or Plain()
        model = self.check_model(body)
        settings = parse_settings(body, chat=False)
        way.check(settings)
        tok = self.engine.tokenizer
        prompts = await way.text_prompts(self, body.get("prompt"))
        asked = settings.max_tokens if settings.max_tokens is not None else 16
        # choice p * n + i: prompt p's i-th sample, as OpenAI and vLLM number them
        jobs = way.jobs(self, prompts, settings, asked)
        if settings.echo and settings.logprobs:  # the prompt's tokens scored too
            for j in jobs:
                j.prompt_logprobs = max(settings.top_logprobs, j.prompt_logprobs or 0)
        shown = way.settings(settings)  # the answer cuts at the stop strings sampled with
        echoes = [""] * len(prompts)
        if settings.echo:
            echoes = await self.off_loop(lambda: [tok.decode(ids) for ids in prompts])
        one = len(prompts) == 1 and asked > 0
        if way.live and one and settings.stream and not settings.logprobs:
            return live_completion(
                self.engine,
                model,
                shown,
                prompts[0],
                jobs,
                lambda i, s: completion_choice(self.engine, i, s, shown),
                echoes[0],
            )
        sampled = await way.sample(self, jobs)
        for i, sm in enumerate(sampled):  # a prompt's samples share its scores
            sm.prompt = sm.prompt or sampled[i - i % settings.n].prompt
        way.replied(sampled[0], None)
        return completion_response(self.engine, model, shown, prompts, echoes, sampled)

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.engine.name,
                    "object": "model",
                    "created": self.engine.created,
                    "owned_by": "peergrade",
                    "max_model_len": self.engine.max_pos,  # vLLM's extension
                }
            ],
        }


def _require_serve(module: str):
    """``starlette`` / ``uvicorn``, or one error line with the pip command (the serve extra)."""
    from peergrade.errors import require

    return require(
        module,
        needed_for="peergrade serve and train --harness (the OpenAI-compatible endpoint)",
        pip="starlette uvicorn",
        extra="serve",
    )


#: the default limit on a request body's bytes (``build_app(max_body_bytes=)``,
#: ``peergrade serve --max-body-mb``): vLLM's and OpenAI's are of this order, and a longer
#: body than this holds more text than any context served here
MAX_BODY_BYTES = 16 * 2**20


def _too_large(limit: int) -> APIError:
    return APIError(
        f"the request body is larger than this server's limit of {limit} bytes "
        "(peergrade serve --max-body-mb)",
        status=413,
        code="request_too_large",
    )


async def _read_json(request, limit: int = MAX_BODY_BYTES) -> dict:
    """The body as a JSON object: refused (413) past ``limit`` bytes, whether the client said
    so in ``Content-Length`` or not (a chunked body is counted as it comes), and parsed on a
    worker thread (a large body does not stall the event loop)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = await asyncio.to_thread(json.loads, raw) if len(raw) > 65536 else json.loads(raw)
    except Exception as e:
        raise APIError(f"the request body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    return body


class ClientGone(Exception):
    """The client disconnected before its reply was ready (nothing is sent)."""


async def _disconnected(request) -> None:
    """Returns once the client of ``request`` (its body read) has disconnected."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return
        await asyncio.sleep(0.05)  # a server that hands out empty body messages: poll


async def _unless_gone(request, work):
    """``await work``, unless the client disconnects first: then ``work`` is cancelled (the
    engine's future with it, so its ``generate`` call stops at its next token:
    ``_Gone``) and ``ClientGone`` is raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        raise ClientGone()
    return task.result()


def _route(fn):
    """An endpoint of ``fn(request)``: a dict is JSON, anything else a server-sent event
    stream; a refused request (``APIError``) or a failure (500) is OpenAI's error shape."""
    from starlette.background import BackgroundTask
    from starlette.responses import JSONResponse, Response, StreamingResponse

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    async def endpoint(request):
        try:
            result = await fn(request)
        except APIError as e:
            return error(e)
        except ClientGone:  # nobody to answer: an empty reply the server cannot send anyway
            return Response(status_code=499)
        except GenerationCancelled as e:  # the server or the run is stopping
            return error(APIError(str(e), status=503, type="server_error", code="stopping"))
        except Exception as e:  # a bug or a model failure: a 500 in the same shape
            return error(APIError(f"{type(e).__name__}: {e}", status=500, type="server_error"))
        if isinstance(result, dict):
            return JSONResponse(result)
        # closed after the stream, also when its client left before it began (a live stream's
        # sampling is cancelled then: ``stream._Live``)
        close = getattr(result, "aclose", None)
        return StreamingResponse(
            result, media_type="text/event-stream", background=close and BackgroundTask(close)
        )

    return endpoint


async def _http_error(request, exc):
    """No such route, or not this method (starlette's ``HTTPException``): OpenAI's error
    shape, as every other refusal."""
    from starlette.responses import JSONResponse

    if exc.status_code == 404:
        msg = f"there is no route {request.url.path} (the OpenAI API is under /v1)"
        code = "not_found"
    elif exc.status_code == 405:
        msg = f"{request.method} is not allowed on {request.url.path}"
        code = "method_not_allowed"
    else:
        msg, code = str(exc.detail), None
    body = APIError(msg, status=exc.status_code, code=code).body()
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def build_app(
    engine: Engine,
    recorder=None,
    *,
    max_tokens: int | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    api_key: str | None = None,
):
    """The Starlette app: the OpenAI routes, and the per-episode routes when a ``recorder``
    (``serving.recorder.Recorder``) is given. A body over ``max_body_bytes`` is a 413; a
    request whose client disconnects is cancelled (``_unless_gone``); an unknown route or
    method is a 404 / 405 in OpenAI's error shape. ``api_key``: every request to ``/v1`` and
    ``/inference`` must carry ``Authorization: Bearer <api_key>`` (vLLM's ``--api-key``),
    else a 401."""
    _require_serve("starlette")
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    handler = Handler(engine, recorder, max_tokens)

    def episode_of(request):
        if recorder is None:
            raise APIError("this server records no episodes", status=404, code="not_found")
        return recorder.get(request.path_params["eid"], request.path_params["key"])

    def route(fn):  # fn(body, way): a POST route, plain or under an episode's URL
        async def answer(request):
            if "eid" not in request.path_params:  # the client's own request: ``Plain``
                body = await _read_json(request, max_body_bytes)
                return await _unless_gone(request, fn(body))
            rec = episode_of(request)  # a training episode's: ``recorder.Recorded``
            retry = request.headers.get("x-stainless-retry-count", "0") not in ("", "0")
            body = await _read_json(request, max_body_bytes)
            # not cancelled when its client leaves: a client that timed out sends it again
            # as a retry, which gets the answer recorded for this one (``recorder``)
            call = fn(body, recorder.way(rec))
            return await recorder._one_at_a_time(rec, call, (fn.__name__, body), retry)

        return _route(answer)

    async def models(request):
        if "eid" in request.path_params:
            episode_of(request)
        return handler.models()

    async def stored(request):  # GET / DELETE a stored response, of the route's store
        store = episode_of(request).stored if "eid" in request.path_params else handler.stored
        rid = request.path_params["rid"]
        return store.retrieve(rid) if request.method == "GET" else store.delete(rid)

    ep = "/v1/episodes/{eid}/{key}"
    posts = {
        "/chat/completions": handler.chat,
        "/completions": handler.completions,
        "/responses": handler.responses,
        # a client that drops a trailing /v1 from the base URL (vLLM's token route sits at
        # the root) cannot drop it from an episode's: that route sits under the episode's URL
        "/inference/v1/generate": handler.generate,
    }
    routes = [
        *(Route(f"{at}/models", _route(models), methods=["GET"]) for at in ("/v1", ep)),
        *(
            Route(f"{at}{path}", route(fn), methods=["POST"])
            for path, fn in posts.items()
            for at in ("" if path.startswith("/inference") else "/v1", ep)
        ),
        *(
            Route(f"{at}/responses/{{rid}}", _route(stored), methods=["GET", "DELETE"])
            for at in ("/v1", ep)
        ),
    ]

    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    return app if not api_key else _KeyCheck(app, api_key)


class _KeyCheck:
    """ASGI middleware: requests to ``/v1`` and ``/inference`` need ``Authorization: Bearer
    <key>`` (compared in constant time); others get a 401 in OpenAI's error shape."""

    _PROTECTED = ("/v1", "/inference")

    def __init__(self, app, key: str):
        self.app, self._want = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and path.startswith(self._PROTECTED):
            given = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not secrets.compare_digest(given, self._want):
                from starlette.responses import JSONResponse

                err = APIError(
                    "incorrect or missing API key: send 'Authorization: Bearer <key>' with "
                    "the key the server was started with (--api-key / PEERGRADE_API_KEY)",
                    status=401,
                    code="invalid_api_key",
                )
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ----------------------------------------------------------------------------- running it


#: seconds an idle client connection is kept open. uvicorn's default, 5 s, is httpx's own
#: pool expiry (the ``openai`` client's): a client that reuses a connection idle for about
#: 5 s can send its request just as the server closes it, and gets a connection error (a
#: training episode's agent between steps; NeMo-Gym#1555 met it with aiohttp's 15 s).
#: Longer than the clients' expiry, the client always drops the connection first.
KEEP_ALIVE_S = 75


#: seconds a client has to send a request's headers once it connects or begins the request,
#: and then its body: a connection that trickles them (slowloris) is closed with a 408
HEADER_TIMEOUT_S = 30.0
BODY_TIMEOUT_S = 120.0


def timed_protocol(header_timeout_s: float = HEADER_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S):
    """uvicorn's httptools protocol with read deadlines, which uvicorn does not have: the
    headers within ``header_timeout_s`` of the connection (or of a kept-alive connection's
    next request beginning), the body within ``body_timeout_s`` of the headers; past one the
    client gets a 408 and the connection is closed (a request being answered is not
    affected: the deadlines end when the body is in). ``"auto"`` (no deadlines) without
    httptools."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "auto"

    class TimedProtocol(HttpToolsProtocol):
        _read_timer = None

        def _arm(self, seconds: float | None) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
            self._read_timer = None
            if seconds is not None:
                self._read_timer = self.loop.call_later(seconds, self._read_timed_out)

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if not self.transport.is_closing():
                if self.cycle is None or not self.cycle.response_started:
                    self.transport.write(
                        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                        b"connection: close\r\ncontent-length: "
                        + str(len(_TIMEOUT_BODY)).encode()
                        + b"\r\n\r\n"
                        + _TIMEOUT_BODY
                    )
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm(header_timeout_s)

        def connection_lost(self, exc) -> None:
            self._arm(None)
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm(header_timeout_s)

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._arm(body_timeout_s)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._arm(None)

    return TimedProtocol


_TIMEOUT_BODY = json.dumps(
    APIError(
        "the request was not received in time (its headers or body came too slowly)",
        status=408,
        code="request_timeout",
    ).body()
).encode()


class Server:
    """The app served by uvicorn on a background thread (the trainer's server; tests).
    ``port=0`` takes a free port; ``url`` is ``http://host:port``. ``header_timeout_s`` /
    ``body_timeout_s``: ``timed_protocol``."""

    def __init__(
        self,
        app,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        header_timeout_s: float = HEADER_TIMEOUT_S,
        body_timeout_s: float = BODY_TIMEOUT_S,
    ):
        uvicorn = _require_serve("uvicorn")

        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            lifespan="off",
            timeout_keep_alive=KEEP_ALIVE_S,
            http=timed_protocol(header_timeout_s, body_timeout_s),
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, name="peergrade-serve", daemon=True
        )
        self.host = host

    def start(self) -> Server:
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server failed to start (see the log above)")
            time.sleep(0.01)
        sock = self._server.servers[0].sockets[0]
        self.port = sock.getsockname()[1]
        self.url = f"http://{self.host}:{self.port}"
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``): only this machine reaches it."""
    import ipaddress

    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Limits:
    """What the clients of ``peergrade serve`` may take: ``max_body_bytes`` of a request body
    (a 413 past it), ``header_timeout_s`` / ``body_timeout_s`` for a slow client
    (``timed_protocol``: a 408), and admission control: ``max_batch_tokens`` KV cache token
    slots per batch (None: ``default_batch_tokens`` of ``kv_memory_bytes``, itself None: of
    the memory free now)."""

    max_body_bytes: int = MAX_BODY_BYTES
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    max_batch_tokens: int | None = None
    kv_memory_bytes: int | None = None


def serve(
    model,
    tokenizer,
    name: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_tokens: int | None = None,
    window_s: float = 0.005,
    api_key: str | None = None,
    limits: Limits = Limits(),
    vllm=None,
) -> None:
    """Serve until interrupted (``peergrade serve``). On Ctrl-C (or SIGTERM) the sampling call
    in flight stops at its next token and its requests are answered with an error, so the
    server's graceful shutdown (which waits for open requests) ends at once, and no thread is
    inside the model when the process exits. Binding an address other than loopback without
    an ``api_key`` prints a warning: anyone who can reach it can use the model. ``limits``:
    the body size, timeouts and admission control (``Limits``). ``vllm``: a
    ``generation.vllm_engine.VllmEngine`` that samples instead of the own kernel (started here,
    from ``model``'s weights), continuously batched; its scheduler admits the work (its KV
    cache), not ``limits.max_batch_tokens``."""
    uvicorn = _require_serve("uvicorn")

    if not api_key and not is_loopback(host):
        print(
            f"warning: serving on {host} without an API key: anyone who can reach this "
            "address can use the model; set --api-key (or PEERGRADE_API_KEY), or bind "
            "127.0.0.1",
            file=sys.stderr,
            flush=True,
        )
    if vllm is not None:
        vllm.start(model, tokenizer)  # here, not at the first request: its errors show now
    engine = Engine(model, tokenizer, name, window_s=window_s, vllm=vllm)
    if vllm is None:
        max_batch_tokens = limits.max_batch_tokens
        if max_batch_tokens is None:
            max_batch_tokens = default_batch_tokens(model, engine.max_pos, limits.kv_memory_bytes)
        engine.max_batch_tokens = max_batch_tokens
        admission = (
            f"at most {max_batch_tokens} KV cache token slots per batch "
            f"({kv_bytes_per_token(model)} bytes each, counting the sampler's buffers and the "
            "prefill's activations too; --max-batch-tokens)"
        )
    else:
        admission = "vLLM's scheduler, within its KV cache (--vllm-kv-cache-gb)"
    print(f"admission: {admission}", file=sys.stderr, flush=True)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            engine.interrupt(wait_s=0)  # does not wait: this is the signal handler
            super().handle_exit(sig, frame)

    app = build_app(
        engine, max_tokens=max_tokens, max_body_bytes=limits.max_body_bytes, api_key=api_key
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="info",
        timeout_keep_alive=KEEP_ALIVE_S,
        http=timed_protocol(limits.header_timeout_s, limits.body_timeout_s),
    )
    server = _Server(config)
    try:
        server.run()
    except KeyboardInterrupt:  # a second Ctrl-C while shutting down
        pass
    finally:
        engine.interrupt()
        engine.close()
    if not server.started:  # uvicorn logged why (the port is taken, ...)
        raise SystemExit(3)
