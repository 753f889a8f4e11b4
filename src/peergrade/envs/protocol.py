"""The native environment protocol: what an episode asks of an environment.

An environment is any object with

- ``reset(row) -> list[dict]``: start an episode for a dataset row; returns the opening chat
  messages (``{"role": ..., "content": ...}``, e.g. a system and a user message);
- ``step(message) -> Step``: the model's turn, as an assistant message dict, goes in; what the
  environment answers (new messages), whether the episode is over and an optional reward come out.

Either method may be ``async``. An optional ``tools`` attribute (a list of JSON schemas, read
after ``reset``) is passed to the chat template when the prompt is rendered. ``step`` may add
keys to the assistant message it is given (the tool adapter adds ``tool_calls`` and strips the
call text from ``content``), so the episode's message list holds the parsed turn.

This module only defines the contract and calls into it; it does not sample, tokenise or parse
tool calls (runner, template and tools do).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class Step:
    """An environment's answer to one model turn.

    Fields:
        messages: new chat messages (roles ``tool``, ``user``, ...) appended to the episode as
            tokens the model reads and is not trained on. When ``done`` they are kept in the
            message list but not tokenised: the model never reads them.
        done: the episode is over.
        reward: optional reward for this turn; an episode's reward is the sum of its turns'
            rewards (None when no turn gave one). The episode keeps each turn's own too
            (``Episode.turn_rewards``): per-turn credit (``algo.turn_credit``) reads them.
        finish_reason: why the episode ended when ``done`` (default ``"done"``).
        tool_calls, tool_failures, tool_truncated: tool calls made, failed, and whose result was
            cut to the output cap in this turn (for metrics).
        state: optional hashable key of the environment state this answer leaves (e.g. a
            board position); ``algo.turn_credit: step_groups`` compares the next turns of a
            group's episodes that share it. None: the answer's tokens are the key.
    """

    messages: list[dict] = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    finish_reason: str | None = None
    tool_calls: int = 0
    tool_failures: int = 0
    tool_truncated: int = 0  # tool results cut to the output cap
    state: Any = None  # a hashable key of the state this answer leaves (step-level credit)


@runtime_checkable
class Environment(Protocol):
    """The native protocol (see the module docstring); sync or async methods."""

    def reset(self, row: Any) -> list[dict]: ...

    def step(self, message: dict) -> Step: ...


def run_sync(awaitable):
    """Run a coroutine to completion from synchronous code, also when the caller is itself
    inside a running event loop (a notebook): then it runs on a helper thread's own loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(awaitable)
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = asyncio.run(awaitable)
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def run_stoppable(awaitable, grace_s: float = 10.0):
    """``run_sync``, on an event loop of its own thread while the caller waits (the harness's
    episodes; not for code under ``limits.call_within``, whose watchdog interrupts only the
    main thread). A stop raised by a signal handler in the caller's thread (the trainer's
    Ctrl-C or SIGTERM) so lands in that wait, never inside the loop's machinery, where it
    would leave tasks half run and print "Task exception was never retrieved"; the
    coroutine is then cancelled (up to ``grace_s`` to unwind) and the stop goes on. What the
    coroutine raises, ``SystemExit`` and ``KeyboardInterrupt`` too, is raised here."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="peergrade-loop", daemon=True)
    thread.start()
    unwound = threading.Event()

    async def main():
        try:  # nothing escapes into the loop's machinery: it would stop the loop unanswered
            return True, await awaitable
        except BaseException as e:
            return False, e
        finally:
            unwound.set()

    try:
        fut = asyncio.run_coroutine_threadsafe(main(), loop)
        try:
            ok, value = fut.result()
        except BaseException:  # a stop in this thread while waiting
            fut.cancel()  # cancels the loop's task
            unwound.wait(grace_s)  # its own cleanup (``finally``, ``except``) runs meanwhile
            raise
    finally:
        with contextlib.suppress(Exception):  # on the loop's thread: the caller may be in one
            asyncio.run_coroutine_threadsafe(loop.shutdown_asyncgens(), loop).result(grace_s)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=grace_s)
        if not thread.is_alive():
            loop.close()
    if not ok:
        raise value
    return value


async def maybe_await(value):
    """``await value`` if it is awaitable, else ``value`` (sync and async methods alike)."""
    if inspect.isawaitable(value):
        return await value
    return value


def check_environment(env: Any, where: str) -> None:
    """Raise an InputError unless ``env`` has callable ``reset`` and ``step``."""
    from peergrade.errors import InputError

    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise InputError(
            f"{where}: {type(env).__name__} has no {' or '.join(missing)} method; an environment "
            "needs reset(row) -> messages and step(assistant_message) -> Step"
        )
