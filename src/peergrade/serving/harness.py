"""Episodes run by an external agent (a "harness") against the policy's own endpoint.

``HarnessRunner(model, tokenizer)`` starts the OpenAI-compatible server (``serving.server``)
on a free local port, with a ``Recorder``; with ``vllm=`` (the run's ``VllmEngine``,
``rollout.engine vllm``) the endpoint samples with it (continuously batched, the behaviour
log-probs vLLM's, the weights those the trainer last pushed to it). ``runner.run(fn, rows, settings, seed=...)``
(``settings``: a ``generation.SamplerSettings``, or its fields as keywords) calls
``fn(row, base_url, model)`` (sync or ``async def``) once per (row, sample), each with a base URL
private to that episode (``http://127.0.0.1:PORT/v1/episodes/<id>/<key>``: only its own
episode's requests are accepted there, ``serving.recorder``), at most ``concurrency`` at
once, and returns one ``HarnessResult`` each: the recorded ``envs.Episode`` (the same record
``generation.episodes`` builds: prompt, sampled tokens with loss mask 1 and the sampler's
log-probs, template/tool tokens with mask 0), the reward and what went wrong.

A harness fails when it raises (``sys.exit()`` included), runs past ``timeout_s``, returns something other than a number
or a dict with a numeric ``reward``, or never calls the server. A failed episode gets reward 0
and its ``error``; the caller decides whether that stops the run. A sync harness that overruns
cannot be killed (Python cannot stop a thread): it is abandoned on a daemon thread, and the
server refuses its episode's later requests. An ``async def`` harness that overruns is cancelled.

With a ``pool`` (``envs.harness_pool``, ``harness.processes``) a sync harness's calls run
in worker processes instead, each on a thread of its worker, with the same results, failures
and error texts; an ``async def`` harness always runs on this process's event loop.

It does not score with reward functions, compute advantages or train.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from peergrade.envs.episode import Episode
from peergrade.envs.harness_pool import EpisodeFailure, HarnessPool, reward_of, turn_rewards_of
from peergrade.envs.protocol import run_stoppable
from peergrade.envs.template import render
from peergrade.errors import describe_exit, users_own_stop
from peergrade.generation.record import SamplerSettings
from peergrade.serving.recorder import EpisodeSettings, Recorder
from peergrade.serving.server import Engine, Server, build_app, mix_key


@dataclass
class HarnessResult:
    episode: Episode
    reward: float
    metrics: dict[str, float] = field(default_factory=dict)  # a dict return's other numbers
    error: str | None = None
    kind: str | None = None  # exception | timeout | bad_return | no_request
    requests: int = 0
    splits: int = 0
    retries: int = 0  # requests the client re-sent (after a timeout), answered again


def _in_thread(fn: Callable, *args) -> asyncio.Future:
    """``fn(*args)`` on a daemon thread, as a future of this loop (an overrunning call is left
    running; its result, if it ever comes, is dropped)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(ok: bool, value) -> None:
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(value)

    def target():
        try:
            value, ok = fn(*args), True
        except BaseException as e:  # handed to the caller
            value, ok = e, False
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, ok, value)

    threading.Thread(target=target, name="peergrade-harness", daemon=True).start()
    return fut


class _Raised(Exception):
    """A ``TimeoutError`` the harness raised (an upstream API's), told apart from the limit's."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


async def _own_timeouts(call):
    try:
        return await call
    except TimeoutError as e:
        raise _Raised(e) from e


class HarnessRunner:
    """The policy's endpoint plus the loop that runs a harness over a batch of rows."""

    def __init__(
        self,
        model,
        tokenizer,
        name: str = "policy",
        *,
        window_s: float = 0.1,
        chat_template: str | None = None,
        keep_cache: bool = True,
        unrendered_tools: bool = False,
        vllm=None,
    ):
        self.name = name
        if vllm is not None:  # built now, from the policy's weights (the trainer's thread)
            vllm.start(model, tokenizer)
        self.engine = Engine(
            model, tokenizer, name, window_s=window_s, chat_template=chat_template, vllm=vllm
        )
        # tools the chat template does not show the model: a 400 (the episode fails, saying
        # why), unless the model knows them already (``env.unrendered_tools``)
        self.engine.unseen_tools = "allow" if unrendered_tools else "error"
        self.recorder = Recorder(self.engine)
        self.engine.expected = self.recorder.open_count
        if keep_cache:  # each episode's KV cache kept between its requests
            self.engine.keep_sessions()
        self.server = Server(build_app(self.engine, self.recorder)).start()

    @property
    def url(self) -> str:
        return self.server.url

    def close(self) -> None:
        self.stop_sampling()
        self.server.stop()
        self.engine.close()

    def stop_sampling(self, wait_s: float = 60.0) -> bool:
        """Stop the sampling call in flight and refuse new requests until the next ``run``
        (a run that stops: Ctrl-C, an error); True once no thread is sampling."""
        return self.engine.interrupt(wait_s)

    def run(
        self,
        fn: Callable,
        rows: Sequence[dict],
        settings: SamplerSettings | None = None,
        *,
        seed: int = 0,
        row_keys: Sequence[int] | None = None,
        concurrency: int | None = None,
        timeout_s: float | None = None,
        pool: HarnessPool | None = None,
        **fields,
    ) -> list[HarnessResult]:
        """One ``HarnessResult`` per (row, sample), episode ``i`` answering row ``i // n``.
        ``settings``: the trainer's sampling, imposed on every request (``SamplerSettings``:
        ``n`` episodes per row, ``max_new_tokens`` the budget of a whole episode,
        ``max_turns``, ``max_tokens_per_turn``, temperature, top-p, top-k, stop strings), or
        its fields as keywords (``max_completion_length`` for ``max_new_tokens``).
        The draws of an episode's turn ``k`` are keyed by (seed, the row's key, the sample
        index, k). ``pool``: a sync ``fn``'s calls run in these worker processes (the same
        harness, loaded there by name) instead of on threads of this process; the episodes
        are the same."""
        aliases = {"max_completion_length": "max_new_tokens"}
        settings = SamplerSettings.given(settings, fields, "HarnessRunner.run", aliases=aliases)
        s = settings
        sampling = s.replace(
            temperature=float(s.temperature), top_p=float(s.top_p), top_k=int(s.top_k)
        )
        self.engine.resume()  # after a stop (``stop_sampling``) the endpoint serves again
        is_async = inspect.iscoroutinefunction(fn)
        pool = pool if pool is not None and not is_async else None
        if pool is not None:
            pool.ensure()  # started, or a dead worker replaced
        keys = list(range(len(rows))) if row_keys is None else list(row_keys)
        n = settings.n
        total = len(rows) * n

        def settings_of(i: int) -> EpisodeSettings:
            return EpisodeSettings(sampling, seed=int(seed), key=mix_key(keys[i // n], i % n))

        async def one(i: int, gate: asyncio.Semaphore) -> HarnessResult:
            row = rows[i // n]
            async with gate:
                rec = self.recorder.open(i // n, settings_of(i))
                base_url = f"{self.url}{rec.path}"
                error = kind = None
                value = None
                try:
                    if is_async:
                        call = fn(row, base_url, self.name)
                    elif pool is not None:
                        call = pool.submit(row, base_url, self.name)
                    else:
                        call = _in_thread(fn, row, base_url, self.name)
                    value = await asyncio.wait_for(_own_timeouts(call), timeout_s)
                except asyncio.TimeoutError:  # the limit (asyncio's is the builtin since 3.11)
                    error = f"TimeoutError: no result within {timeout_s:g} s (harness.timeout_s)"
                    kind = "timeout"
                except _Raised as e:  # a TimeoutError the harness raised itself
                    error, kind = f"{type(e.error).__name__}: {e.error}", "exception"
                except EpisodeFailure as e:  # the same failure, reported by a worker process
                    error, kind = e.text, e.kind
                except Exception as e:
                    error, kind = f"{type(e).__name__}: {e}", "exception"
                except BaseException as e:  # its sys.exit() / KeyboardInterrupt: its failure
                    if not users_own_stop(e):  # the run stops: the episode is dropped
                        self.recorder.close(rec.eid)
                        raise
                    error, kind = describe_exit(e), "exception"
                rec = self.recorder.close(rec.eid)
            return self._result(rec, i // n, row, value, error, kind)

        async def all_of():
            gate = asyncio.Semaphore(concurrency or max(total, 1))
            return await asyncio.gather(*(one(i, gate) for i in range(total)))

        return run_stoppable(all_of())  # a Ctrl-C lands in its wait, not inside the loop

    def _result(self, rec, row_index: int, row, value, error, kind) -> HarnessResult:
        """The ``HarnessResult`` of a closed recording ``rec``: the harness's ``value`` checked
        (a number or a dict with a numeric reward), a harness that never called the server
        named, and a failed one (``error``, ``kind``) scored 0."""
        reward, extra = 0.0, {}
        if error is None:
            try:
                reward, extra = reward_of(value)
            except TypeError as e:
                error, kind = str(e), "bad_return"
        ep = rec.episode
        if ep is None:
            if error is None:
                error, kind = "the harness never called the server", "no_request"
            ep = self._empty_episode(row_index, row)
        if error is not None:
            reward = 0.0
        if not ep.finish_reason:  # the harness ended the conversation itself
            ep.finish_reason = "done"
        ep.reward = reward
        ep.turn_rewards = (None if error else turn_rewards_of(value)) or []  # per-turn credit
        return HarnessResult(ep, reward, extra, error, kind, rec.requests, rec.splits, rec.retries)

    def _empty_episode(self, row_index: int, row: dict) -> Episode:
        """The record of an episode that sampled nothing: its prompt, no completion."""
        msgs = row.get("prompt") if isinstance(row, dict) else None
        if isinstance(msgs, str):
            msgs = [{"role": "user", "content": msgs}]
        tok = self.engine.tokenizer
        try:
            ids = render(
                tok, msgs, add_generation_prompt=True, chat_template=self.engine.chat_template
            )
        except Exception:
            msgs, ids = [], []
        if not ids:
            ids = [tok.eos_token_id if tok.eos_token_id is not None else tok.pad_token_id]
        return Episode(
            row_index, ids, list(msgs or []), len(msgs or []), finish_reason="no_request"
        )


def harness_metrics(results: Sequence[HarnessResult]) -> dict[str, float]:
    """``harness/failed`` and one rate per kind of failure, ``harness/requests_mean``,
    ``harness/split_episodes`` (episodes whose history the client changed),
    ``harness/retried_requests`` (requests re-sent by the client, per episode) and the means of
    the harness's own numbers (``harness/<name>``)."""
    n = len(results)
    if n == 0:
        return {}
    out = {
        "harness/failed": sum(r.error is not None for r in results) / n,
        "harness/requests_mean": sum(r.requests for r in results) / n,
        "harness/split_episodes": sum(r.splits > 0 for r in results) / n,
        "harness/retried_requests": sum(r.retries for r in results) / n,
    }
    for kind in ("exception", "timeout", "bad_return", "no_request"):
        out[f"harness/failed_{kind}"] = sum(r.kind == kind for r in results) / n
    names = sorted({k for r in results for k in r.metrics})
    for k in names:
        vals = [r.metrics[k] for r in results if k in r.metrics]
        out[f"harness/{k}"] = sum(vals) / len(vals)
    return out
