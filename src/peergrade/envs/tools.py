"""TRL's tool contract as a native environment: ``tools=[fn, ...]``, ``environment_factory``,
``max_tool_calling_iterations``.

- A tool is a plain function (sync or async) with type hints and a Google-style docstring; its
  JSON schema comes from ``transformers.utils.get_json_schema`` (as TRL does) and is passed to the
  chat template. A function without them is one InputError naming it.
- ``environment_factory`` is a class (or a dict of classes picked per row by its
  ``environment`` column): one instance per episode; ``reset(**row) -> str | None`` starts the
  episode (a returned string is appended to the last prompt message, as TRL does); its other
  public methods are the episode's tools; an optional ``get_reward()`` is left to the caller
  (the instance is ``ToolEnvironment.instance``).
- A model turn's tool calls are parsed in the Hermes / Qwen2 format,
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; every call of a turn runs (async
  ones concurrently, after the sync ones, as in TRL). A malformed call, an unknown tool, bad
  arguments or a tool that raises becomes a tool message ``{'error': '...'}`` to the model and
  is counted as a failure; it never stops the run. Results are sent as ``str(result)`` (TRL).
  A result that is not a str, a number, a bool, None or lists/dicts of those (a ``bytes``, an
  object whose text would be its memory address) is the tool's bug, not the model's: an
  InputError naming the tool stops the run, and a return type hint that is not JSON (read by
  ``get_json_schema``) is refused at start-up, before a model loads.
- A turn without tool calls ends the episode (``finish_reason`` ``"answer"``); a turn with tool
  calls after ``max_tool_calling_iterations`` rounds ends it unexecuted (``"max_tool_calls"``).

Beyond TRL: a per-call timeout (a sync tool runs in a worker process forked from the trainer,
``envs.tool_workers``, killed with its process group when it overruns, so a spinning tool stops
using the CPU; an async one is cancelled; the timed-out calls of a batch are one warning line per
tool, ``ToolLimiter.report``), a cap on the characters of a tool result (the cut is marked
in the text and counted), a bound on the tool calls running at once across a batch's episodes
(each sync call runs in a worker of its own, so episodes do not wait for each other's tools),
and a tool's ``sys.exit()`` / ``KeyboardInterrupt`` / ``os._exit()`` is its failed call, not the
end of the run. A tool method of an environment instance that cannot be pickled runs on a thread
of the trainer instead (stopped past its limit by an exception raised in it: Python code stops,
C code that never returns cannot), said once per class.

Llama 3's JSON calls (``{"name": ..., "parameters": ...}``) are parsed when the chat template
writes them (``ToolEnvironment.tool_format``, set from ``model.chat_templates.tool_format`` by
whoever knows the tokenizer: the factory's ``tool_format`` attribute). Not done here: other
families' call formats (Mistral ``[TOOL_CALLS]``) and the code sandbox for Python-code tools.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import numbers
import re
import sys
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from peergrade.envs.protocol import Step
from peergrade.errors import InputError, PeergradeError

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"


def tool_schema(fn: Callable, where: str = "tools") -> dict:
    """The JSON schema of ``fn`` (``get_json_schema``), or an InputError naming it."""
    from transformers.utils import get_json_schema

    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))
    if not callable(fn):
        raise InputError(f"{where}: {fn!r} is not callable; a tool is a function")
    try:
        schema = get_json_schema(fn)
    except Exception as e:
        raise InputError(
            f"{where}: tool {name} has no usable schema ({e}); a tool needs type hints on every "
            "argument and a Google-style docstring with an Args: section describing each one"
        ) from e
    # get_json_schema leaves out a return type it cannot express in JSON instead of failing
    returns = inspect.signature(fn).return_annotation
    if returns is not inspect.Signature.empty and "return" not in schema["function"]:
        raise InputError(
            f"{where}: tool {name} returns {getattr(returns, '__name__', returns)!s}, which is "
            f"not JSON-serialisable; {RESULTS}"
        )
    return schema


#: what a tool may return (the error messages' wording)
RESULTS = "a tool must return a str, a number, a bool, None, or lists/dicts of those"


def _serialisable(value: Any) -> bool:
    if value is None or isinstance(value, (str, bool, numbers.Number)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_serialisable(v) for v in value)
    if isinstance(value, dict):
        return all(
            isinstance(k, (str, numbers.Number)) and _serialisable(v) for k, v in value.items()
        )
    return False


def check_result(name: str, value: Any) -> Any:
    """``value`` if a tool may return it (see ``RESULTS``), else an InputError naming the tool."""
    if not _serialisable(value):
        raise InputError(
            f"tool {name} returned a {type(value).__name__} ({repr(value)[:80]}), which the "
            f"model cannot read as text; {RESULTS}"
        )
    return value


def parse_tool_calls(text: str, fmt: str = "hermes") -> tuple[str, list[dict], list[str]]:
    """Split an assistant turn into (content without the calls, calls, errors).

    ``fmt``: the call format of the chat template (``model.chat_templates.tool_format``):
    ``"hermes"`` (below) or ``"llama3"`` (``parse_llama3_tool_calls``).

    Calls are ``{"type": "function", "function": {"name": str, "arguments": dict}}`` (the
    message format chat templates render); ``arguments`` may also arrive as a JSON string. Each
    block that is not such a JSON object, and an unclosed ``<tool_call>``, is one error string,
    and its raw text stays in the content: the logged messages, the report and the reward
    functions see what the model wrote, as the trained tokens are what it sampled.
    """
    if fmt == "llama3":
        return parse_llama3_tool_calls(text)
    if fmt != "hermes":
        raise ValueError(f"tool call format {fmt!r}: expected 'hermes' or 'llama3'")
    calls: list[dict] = []
    errors: list[str] = []

    def one(m: re.Match) -> str:
        """'' for a well-formed call (it moves to ``calls``), else the block as written."""
        raw = m.group(1).strip()
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            errors.append(f"tool call is not valid JSON ({e.msg}): {raw[:200]}")
            return m.group(0)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            errors.append(
                f'tool call must be {{"name": ..., "arguments": {{...}}}}, got {raw[:200]}'
            )
            return m.group(0)
        args = obj.get("arguments", {})
        if isinstance(args, str):
            with contextlib.suppress(json.JSONDecodeError):  # reported as not an object below
                args = json.loads(args) if args.strip() else {}
        if not isinstance(args, dict):
            errors.append(
                f"arguments of tool call {obj['name']} must be a JSON object, got {args!r}"
            )
            return m.group(0)
        calls.append({"type": "function", "function": {"name": obj["name"], "arguments": args}})
        return ""

    rest = _CALL.sub(one, text)
    if _OPEN in _CALL.sub("", text):
        errors.append("unclosed <tool_call> (no </tool_call>)")
    return rest.strip(), calls, errors


_PYTHON_TAG = "<|python_tag|>"


def parse_llama3_tool_calls(text: str) -> tuple[str, list[dict], list[str]]:
    """``parse_tool_calls`` for Llama 3's JSON calls: a turn that is (after an optional
    ``<|python_tag|>``) one or more ``{"name": ..., "parameters": {...}}`` objects (``arguments``
    is read too), separated by ``;`` or whitespace, is calls with content ""; a turn that starts
    otherwise is an answer. A turn that starts with ``<|python_tag|>`` or ``{"name"`` but is not
    such a list of objects is one error, its text kept as the content."""
    stripped = text.strip()
    tagged = stripped.startswith(_PYTHON_TAG)
    body = stripped[len(_PYTHON_TAG) :].strip() if tagged else stripped
    if not tagged and not re.match(r'\{\s*"name"\s*:', body):
        return stripped, [], []
    decoder = json.JSONDecoder()
    calls: list[dict] = []
    i = 0
    while i < len(body):
        if body[i] in "; \t\r\n":
            i += 1
            continue
        try:
            obj, i = decoder.raw_decode(body, i)
        except json.JSONDecodeError as e:
            return stripped, [], [f"tool call is not valid JSON ({e.msg}): {body[:200]}"]
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            shape = '{"name": ..., "parameters": {...}}'
            return stripped, [], [f"tool call must be {shape}, got {body[:200]}"]
        args = obj.get("parameters", obj.get("arguments", {}))
        if isinstance(args, str):
            with contextlib.suppress(json.JSONDecodeError):
                args = json.loads(args) if args.strip() else {}
        if not isinstance(args, dict):
            bad = f"arguments of tool call {obj['name']} must be a JSON object, got {args!r}"
            return stripped, [], [bad]
        calls.append({"type": "function", "function": {"name": obj["name"], "arguments": args}})
    if not calls:
        return stripped, [], [f"{_PYTHON_TAG} with no tool call after it"]
    return "", calls, []


class ToolLimiter:
    """At most ``concurrency`` tool calls at once across every episode of a batch (the episodes
    of a step run their tools concurrently: one slow tool does not hold up the others). Shared
    by the environments of one factory; a semaphore per event loop (each batch runs its own)."""

    def __init__(self, concurrency: int | None = None, tools: Sequence[Callable] = ()):
        from peergrade.envs.tool_workers import ToolWorkers

        self.concurrency = concurrency
        self._loop: Any = None
        self._sem: asyncio.Semaphore | None = None
        # the sync calls' processes (envs.tool_workers)
        self.workers = ToolWorkers(tools, check=check_result, exited=ToolExited)
        self.timeouts: Counter = Counter()  # timed-out calls per tool since the last report
        self.timeout: float | None = None
        self.on_threads: set[str] = set()  # classes whose tool methods run on threads

    def report(self) -> list[str]:
        """One warning line per tool whose calls timed out since the last report (the end of a
        batch of episodes: ``run_episodes`` calls it), printed to stderr; the lines."""
        lines = [
            f"warning: tool {name}: {n} call{'s' if n > 1 else ''} timed out in this batch "
            f"(env.tool_timeout {self.timeout:g} s) and {'were' if n > 1 else 'was'} stopped; "
            "each is a failed call the model reads as 'timed out'"
            for name, n in sorted(self.timeouts.items())
        ]
        self.timeouts.clear()
        for line in lines:
            print(line, file=sys.stderr, flush=True)
        return lines

    def slot(self):
        if self.concurrency is None:
            return contextlib.nullcontext()
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._sem = loop, asyncio.Semaphore(self.concurrency)
        return self._sem


class ToolExited(Exception):
    """A tool that called ``sys.exit()`` or raised ``KeyboardInterrupt``: its failed call."""


async def _in_thread(fn: Callable, args: dict, timeout: float | None):
    """``fn(**args)`` on a daemon thread of its own, awaited (at most ``timeout`` seconds): the
    event loop runs other episodes' tools meanwhile (the tools a worker process cannot take).
    A call that overruns is stopped by an exception raised in its thread (``limits.stop_thread``:
    Python code stops, C code that never returns to Python cannot); the episode goes on without
    it. Its ``sys.exit()`` / ``KeyboardInterrupt`` is its failure (``ToolExited``)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(value, error):
        if done.done():  # timed out and abandoned
            return
        if error is None:
            done.set_result(value)
        else:
            done.set_exception(error)

    def target():
        value = error = None
        try:
            value = fn(**args)
        except Exception as e:
            error = e
        except BaseException as e:  # sys.exit(), KeyboardInterrupt: this call's failure
            error = ToolExited(
                f"called sys.exit({e.code!r})"
                if isinstance(e, SystemExit)
                else "raised KeyboardInterrupt"
            )
        with contextlib.suppress(RuntimeError):  # the batch's loop is closed: abandoned
            loop.call_soon_threadsafe(settle, value, error)

    thread = threading.Thread(target=target, name="peergrade-tool", daemon=True)
    thread.start()
    if timeout is None:
        return await done
    try:
        return await asyncio.wait_for(done, timeout)
    except asyncio.TimeoutError:
        from peergrade.limits import stop_thread

        stop_thread(thread)
        raise TimeoutError(f"timed out after {timeout:g}s") from None


async def _awaited(awaitable, timeout: float | None):
    """An async tool's result (at most ``timeout`` seconds); its exit is its failure."""
    try:
        if timeout is None:
            return await awaitable
        return await asyncio.wait_for(awaitable, timeout)
    except (TimeoutError, asyncio.TimeoutError):
        raise TimeoutError(f"timed out after {timeout:g}s") from None
    except asyncio.CancelledError:
        raise
    except Exception:
        raise
    except BaseException as e:  # sys.exit(), KeyboardInterrupt inside the tool
        raise ToolExited(
            f"called sys.exit({e.code!r})"
            if isinstance(e, SystemExit)
            else "raised KeyboardInterrupt"
        ) from None


async def _run_sync(fn: Callable, args: dict, timeout, limiter: ToolLimiter, instance) -> Any:
    """A sync tool's result: in a worker process (``envs.tool_workers``), or on a thread for a
    tool the workers cannot take (a function they do not know, an instance that does not
    pickle); its exceptions are raised."""
    from peergrade.envs.tool_workers import NotPicklable, WorkerDied

    workers = limiter.workers
    if instance is not None and getattr(fn, "__self__", None) is instance:
        target: Any = (instance, fn.__name__)
    else:
        target = workers.index(fn)
    if target is not None and type(instance).__name__ not in limiter.on_threads:
        try:
            return await workers.call(target, args, timeout)
        except NotPicklable as e:
            cls = type(instance).__name__
            limiter.on_threads.add(cls)
            print(
                f"warning: the tool methods of {cls} run on the trainer's threads, not in worker "
                f"processes: its instances cannot be pickled ({e}); a timed-out call is "
                "interrupted, and one stuck in C code keeps its thread",
                file=sys.stderr,
                flush=True,
            )
        except WorkerDied as e:
            raise RuntimeError(str(e)) from None
    return await _in_thread(fn, args, timeout)


async def _call_tools(
    calls: list[dict],
    registry: dict[str, Callable],
    timeout: float | None = None,
    limiter: ToolLimiter | None = None,
    instance: Any = None,
) -> list[tuple[str, Any, bool]]:
    """(name, result, failed) per call, in call order; sync tools run in order, async ones
    together afterwards (TRL's order of execution), each in its own worker process / task so
    other episodes' calls run meanwhile (at most ``limiter.concurrency`` at once). With
    ``timeout``, a call that takes longer is stopped and fails with a timeout error (counted
    in ``limiter.timeouts``)."""
    limiter = limiter or ToolLimiter(tools=list(registry.values()))
    limiter.timeout = timeout
    out: list[tuple[str, Any, bool] | None] = [None] * len(calls)
    pending: list[tuple[int, str, Any]] = []
    for i, call in enumerate(calls):
        name, args = call["function"]["name"], call["function"]["arguments"]
        fn = registry.get(name)
        if fn is None:
            out[i] = (name, {"error": f"Tool {name} not found."}, True)
            continue
        try:
            if inspect.iscoroutinefunction(fn):
                result = fn(**args)
            else:
                async with limiter.slot():
                    result = await _run_sync(fn, args, timeout, limiter, instance)
        except PeergradeError:
            raise  # the setup is wrong, not the call (e.g. a sandbox that cannot contain code)
        except Exception as e:
            if isinstance(e, TimeoutError):
                limiter.timeouts[name] += 1
            out[i] = (name, {"error": str(e) or type(e).__name__}, True)
            continue
        if inspect.isawaitable(result):
            pending.append((i, name, result))
        else:
            out[i] = (name, check_result(name, result), False)
    if pending:

        async def limited(awaitable):
            async with limiter.slot():
                return await _awaited(awaitable, timeout)

        results = await asyncio.gather(*(limited(c) for _, _, c in pending), return_exceptions=True)
        for (i, name, _), r in zip(pending, results):
            if isinstance(r, PeergradeError):
                raise r
            failed = isinstance(r, Exception)
            if isinstance(r, TimeoutError):
                limiter.timeouts[name] += 1
            out[i] = (
                name,
                {"error": str(r) or type(r).__name__} if failed else check_result(name, r),
                failed,
            )
    return out  # type: ignore[return-value]


def _truncate(text: str, limit: int | None) -> str:
    if limit is None or len(text) <= limit:
        return text
    return text[:limit] + f"... [truncated {len(text) - limit} characters]"


def _result_text(result: Any, limit: int | None) -> tuple[str, bool]:
    """A tool's result as the model reads it, cut to ``limit`` characters; whether it was cut.
    A long str is cut before anything else is done with it; another value is turned into text
    first (``str``, as TRL does)."""
    text = result if isinstance(result, str) else str(result)
    return _truncate(text, limit), limit is not None and len(text) > limit


def _public_methods(cls: type) -> list[str]:
    # Listed on the class: inspecting the instance would evaluate properties.
    return [
        n
        for n, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not n.startswith("_") and n not in ("reset", "get_reward")
    ]


def _check_factory(factory: Any, where: str) -> None:
    cls = factory if isinstance(factory, type) else None
    if cls is None:
        if not callable(factory):
            raise InputError(
                f"{where}: {factory!r} is not a class or a callable that makes environments"
            )
        cls = type(factory())
    if not callable(getattr(cls, "reset", None)):
        raise InputError(
            f"{where}: {cls.__name__} has no reset method; an environment class needs "
            "reset(**row) -> str | None (its other public methods are the tools)"
        )
    for name in _public_methods(cls):
        tool_schema(getattr(cls, name), f"{where}: {cls.__name__}")


def _with_observation(messages: list[dict], observation) -> list[dict]:
    """The opening messages with ``reset``'s observation appended to the last one (TRL)."""
    if observation is None:
        return messages
    last = messages[-1]
    return messages[:-1] + [{**last, "content": last["content"] + str(observation)}]


async def _observed(messages: list[dict], awaitable) -> list[dict]:
    return _with_observation(messages, await awaitable)


class ToolEnvironment:
    """One episode of TRL's contract, speaking the native protocol (see the module docstring)."""

    def __init__(
        self,
        tools: Sequence[Callable] = (),
        instance: Any = None,
        max_tool_calling_iterations: int | None = None,
        tool_timeout: float | None = None,
        max_tool_output_chars: int | None = None,
        limiter: ToolLimiter | None = None,
        tool_format: str = "hermes",
    ):
        self.instance = instance
        self.tool_format = tool_format  # the chat template's call format (parse_tool_calls)
        fns = list(tools)
        self.limiter = limiter or ToolLimiter(tools=fns)
        if instance is not None:
            fns += [getattr(instance, n) for n in _public_methods(type(instance))]
        self.registry = {fn.__name__: fn for fn in fns}
        self.tools = [tool_schema(fn) for fn in fns] or None
        self.max_iterations = max_tool_calling_iterations
        self.timeout, self.max_chars = tool_timeout, max_tool_output_chars
        self.iterations = 0

    # every tool call of a step has its own limit (tool_timeout) and waits for a free slot
    # (tool_concurrency): the episode engine does not limit the step as a whole again
    bounds_own_step = True

    def reset(self, row: dict):
        """The opening messages; the instance's ``reset(**row)`` runs inside this call when it
        is sync (so the episode engine's time limit, ``env.timeout_s``, covers it), and the
        result is a coroutine when it is ``async def``."""
        prompt = row["prompt"] if isinstance(row, dict) and "prompt" in row else None
        if prompt is None:
            raise InputError(
                f"row {row!r}: expected a 'prompt' column (a string or a message list)"
            )
        messages = (
            [{"role": "user", "content": prompt}]
            if isinstance(prompt, str)
            else [dict(m) for m in prompt]
        )
        if self.instance is None:
            return messages
        kwargs = {k: v for k, v in row.items() if k != "environment"}
        # what it raises is named by the episode engine (the class, the row, the line)
        observation = self.instance.reset(**kwargs)
        if inspect.isawaitable(observation):
            return _observed(messages, observation)
        return _with_observation(messages, observation)

    async def step(self, message: dict) -> Step:
        content, calls, errors = parse_tool_calls(message["content"], self.tool_format)
        if not calls and not errors:
            return Step(done=True, finish_reason="answer")
        if self.max_iterations is not None and self.iterations >= self.max_iterations:
            return Step(done=True, finish_reason="max_tool_calls")
        self.iterations += 1
        message["content"] = content
        if calls:
            message["tool_calls"] = calls
        results = await _call_tools(calls, self.registry, self.timeout, self.limiter, self.instance)
        answers, truncated = [], 0
        for name, result, failed in results:
            # errors are ours and short: only what a tool returned is capped
            if isinstance(result, list):
                content = result
            elif failed:
                content = str(result)
            else:
                content, cut = _result_text(result, self.max_chars)
                truncated += cut
            answers.append({"role": "tool", "name": name, "content": content})
        answers += [
            {"role": "tool", "name": "invalid_tool_call", "content": str({"error": e})}
            for e in errors
        ]
        failures = sum(failed for _, _, failed in results) + len(errors)
        return Step(
            messages=answers,
            tool_calls=len(calls) + len(errors),
            tool_failures=failures,
            tool_truncated=truncated,
        )


def _check_limits(
    max_tool_calling_iterations: int | None,
    tool_timeout: float | None,
    max_tool_output_chars: int | None,
    tool_concurrency: int | None,
) -> None:
    """``tool_environment_factory``'s limits, each None or a number in its range (a bool is
    not a number here)."""
    if max_tool_calling_iterations is not None and (
        isinstance(max_tool_calling_iterations, bool)
        or not isinstance(max_tool_calling_iterations, int)
        or max_tool_calling_iterations < 0
    ):
        raise InputError(
            f"max_tool_calling_iterations must be an int >= 0 or None, got {max_tool_calling_iterations!r}"
        )

    if tool_timeout is not None and (
        isinstance(tool_timeout, bool)
        or not isinstance(tool_timeout, (int, float))
        or not tool_timeout > 0
    ):
        raise InputError(
            f"tool_timeout must be a number of seconds > 0 or None, got {tool_timeout!r}"
        )
    if max_tool_output_chars is not None and (
        isinstance(max_tool_output_chars, bool)
        or not isinstance(max_tool_output_chars, int)
        or max_tool_output_chars < 1
    ):
        raise InputError(
            f"max_tool_output_chars must be an int >= 1 or None, got {max_tool_output_chars!r}"
        )

    if tool_concurrency is not None and (
        isinstance(tool_concurrency, bool)
        or not isinstance(tool_concurrency, int)
        or tool_concurrency < 1
    ):
        raise InputError(f"tool_concurrency must be an int >= 1 or None, got {tool_concurrency!r}")


def tool_environment_factory(
    tools: Sequence[Callable] | None = None,
    environment_factory: Any = None,
    max_tool_calling_iterations: int | None = None,
    *,
    tool_timeout: float | None = None,
    max_tool_output_chars: int | None = None,
    tool_concurrency: int | None = None,
) -> Callable[[Any], ToolEnvironment]:
    """A ``row -> ToolEnvironment`` factory for ``run_episodes`` from TRL's arguments, checked
    now (before any model loads): every tool has a schema, every environment class a ``reset``
    and schema'd public methods. A dict ``environment_factory`` is picked per row by the row's
    ``environment`` column.

    Beyond TRL: ``tool_timeout`` (seconds per call; an overrun is a failed call) and
    ``max_tool_output_chars`` (a longer result is cut, with a note saying how much was cut,
    and counted: ``Step.tool_truncated``), ``tool_concurrency`` (tool calls running at once
    across the episodes of a batch; None = no bound)."""
    tools = list(tools or [])
    for fn in tools:
        tool_schema(fn)
        # a tool's own start-up check (envs.python_tool: the sandbox's self-test, fail closed)
        check = getattr(fn, "startup_check", None)
        if callable(check):
            check()
    if isinstance(environment_factory, dict):
        for key, f in environment_factory.items():
            _check_factory(f, f"environment_factory[{key!r}]")
    elif environment_factory is not None:
        _check_factory(environment_factory, "environment_factory")
    _check_limits(
        max_tool_calling_iterations, tool_timeout, max_tool_output_chars, tool_concurrency
    )
    limiter = ToolLimiter(tool_concurrency, tools)

    def make(row: Any) -> ToolEnvironment:
        factory = environment_factory
        if isinstance(factory, dict):
            key = row.get("environment") if isinstance(row, dict) else None
            if key not in factory:
                raise InputError(
                    f"row {row!r}: its 'environment' column must be one of {sorted(factory)}, got {key!r}"
                )
            factory = factory[key]
        instance = factory() if factory is not None else None
        return ToolEnvironment(
            tools,
            instance,
            max_tool_calling_iterations,
            tool_timeout,
            max_tool_output_chars,
            limiter,
            make.tool_format,
        )

    # the chat template's call format: set by whoever prepares the tokenizer (the trainer,
    # ``peergrade eval``) from ``model.chat_templates.tool_format``; read at each episode
    make.tool_format = "hermes"
    make.end_batch = limiter.report  # run_episodes: the batch's timed-out calls, one line a tool
    return make
