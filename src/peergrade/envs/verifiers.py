"""verifiers environments (PyPI ``verifiers``, versions >=0.4,<0.5: its v1 API) trained as
native peergrade environments: ``peergrade train --env verifiers:MODULE``.

``load_verifiers(spec)`` imports MODULE (an importable module, or ``path/to/file.py``), calls its
``load_environment()`` and returns the checked ``row -> environment`` factory the trainer runs,
with ``factory.task``: the taskset's tasks as a peergrade task (one row per task, the task's data
in the ``verifiers_task`` column), whose reward ``verifiers_reward`` is each episode's
``trace.reward`` (the weighted sum of the task's ``@vf.reward`` functions, as verifiers sums it).

``load_environment()`` may return a ``vf.SingleAgentEnv`` (its taskset and its agent's
``max_turns``) or a ``vf.Taskset``. An episode is the plain chat loop of verifiers' ``null``
harness, run in this process: the model's turn is sampled by peergrade's engine (token in,
token out), its Hermes ``<tool_call>`` blocks call the tools of the task's and the taskset's
``vf.Toolset`` servers (in-process, through the MCP server verifiers itself builds, so the
schemas and argument validation are verifiers'), their results come back as tool messages, and
a turn without tool calls ends the episode (``"answer"``). Before each model turn the task's
``@vf.stop`` functions on the ``Trace`` (and ``Request``) run, after it those on the
``Response``; one that fires ends the episode with its name as the finish reason. The episode's
messages are kept as a ``vf.Trace``, which the task's ``score`` reads.

Why not verifiers' own loop (its ``Client``): in 0.4.0 every harness, the plain chat one
included, runs the model loop as a separate program prepared with ``uv sync --script`` (``uv``
downloaded from astral.sh or PyPI when missing, then the program's dependencies resolved from
PyPI), talking over HTTP to an interception server that calls a ``Client`` built from an
endpoint config (``resolve_client``), with tools served as MCP servers in subprocesses. With no
network and no ``uv`` here, preparing the program fails before any model call, and no public
hook hands verifiers a ``Client`` object. So this module implements the loop, not the Client.

Refused at load time, each with one error saying what it needs: a multi-agent ``Env``, a pinned
harness other than ``null`` (its program and its tools, e.g. bash's shell, run in a sandbox
runtime), a task that needs a container (``NEEDS_CONTAINER``, ``image``) or overrides
``setup``/``finalize`` (they take the sandbox runtime), rewards or metrics that need the
runtime, judges (a judge model served over the network), a Toolset placed in a remote runtime or
at a hosted ``url``, ``@vf.intercept`` hooks (they rewrite sampled turns), a task without a
prompt (a simulated user opens it), an unbounded taskset.

Not done here: Toolset state (``self.state``) synced to ``trace.state`` (each call starts from
a fresh state, as it does without verifiers' state channel), token limits of the agent
(peergrade's budgets apply instead), MCP content other than text.

The verifiers names this module uses (its whole dependency on the package): ``verifiers.__version__``;
``verifiers.v1``: ``Env``, ``SingleAgentEnv``, ``Taskset`` (iteration, ``bounded``,
``task_type``, ``toolsets``, ``config``), ``Task`` (``data``, ``config``, ``toolsets``,
``hooks``, ``score``, ``key``, ``hash``, ``data_type``, ``NEEDS_CONTAINER``), ``Toolset``
(``register``, ``server_name``, ``setup``, ``setup_task``, ``config.url`` / ``runtime``),
``SubprocessConfig``, ``Trace``, ``TraceTask``, ``AgentInfo``, ``AgentConfig``,
``MessageNode``, ``Message``, ``AssistantMessage``, ``ToolCall``, ``ToolMessage``,
``Request``, ``Response``; and ``mcp.server.mcpserver.MCPServer`` (``list_tools``,
``call_tool``), the MCP server class verifiers registers its tools on.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import time
import uuid
from collections.abc import Callable
from typing import Any, get_type_hints

from peergrade.envs.protocol import Step, run_sync
from peergrade.envs.tools import _call_tools, _truncate, parse_tool_calls
from peergrade.errors import InputError, PeergradeError, require

PREFIX = "verifiers:"
VERSIONS = ">=0.4,<0.5"  # the v1 API this module is written against (tested with 0.4.0)
COLUMN = "verifiers_task"  # the row column holding a task's data


def is_verifiers_spec(spec: Any) -> bool:
    """Whether ``--env`` / ``env.factory`` names a verifiers environment (``verifiers:MODULE``)."""
    return isinstance(spec, str) and spec.strip().startswith(PREFIX)


def _import_vf():
    """``verifiers.v1``, or one error: not installed, or a version outside ``VERSIONS``."""
    from packaging.version import Version

    verifiers = require(
        "verifiers",
        needed_for="--env verifiers:MODULE",
        pip="'verifiers>=0.4,<0.5'",
        extra="verifiers",
    )
    version = getattr(verifiers, "__version__", "0")
    if not Version("0.4") <= Version(version) < Version("0.5"):
        raise InputError(
            f"--env verifiers:...: verifiers {version} is installed; peergrade supports "
            f"verifiers{VERSIONS} (its v1 API): pip install 'verifiers{VERSIONS}'"
        )
    return importlib.import_module("verifiers.v1")


def _load_module(target: str, what: str):
    from peergrade.rewards.registry import _load_file

    if target.endswith(".py") or "/" in target or "\\" in target:
        try:
            return _load_file(target, "load_environment", what=what)
        except ValueError as e:
            if "has no attribute" in str(e):
                raise InputError(
                    f"{what}: {target} defines no load_environment(); a verifiers environment "
                    "module defines load_environment() returning a vf.SingleAgentEnv or vf.Taskset"
                ) from None
            raise InputError(str(e)) from None
    try:
        module = importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name and (target == e.name or target.startswith(e.name + ".")):
            raise InputError(f"{what}: module {target!r} cannot be imported ({e})") from None
        raise
    fn = getattr(module, "load_environment", None)
    if not callable(fn):
        raise InputError(
            f"{what}: module {target!r} has no load_environment(); a verifiers environment "
            "module defines load_environment() returning a vf.SingleAgentEnv or vf.Taskset"
        )
    return fn


def load_verifiers(
    spec: str, *, tool_timeout: float | None = None, max_tool_output_chars: int | None = None
) -> Callable[[Any], VerifiersEnvironment]:
    """The checked ``row -> VerifiersEnvironment`` factory of ``verifiers:MODULE`` (see the
    module docstring), with ``.task`` (the rows and the reward) and ``.environment_class``
    (None: the reward is ``verifiers_reward``, a reward of the task, not the trainer's ``env``).
    ``tool_timeout`` / ``max_tool_output_chars``: ``env.*``'s, applied to the Toolsets' calls
    as to TRL tools'."""
    vf = _import_vf()
    target = spec.strip()[len(PREFIX) :].strip()
    what = f"--env {spec.strip()!r}"
    if not target:
        raise InputError(f"{what}: expected verifiers:MODULE or verifiers:path/to/file.py")
    loaded = _call_loader(_load_module(target, what), what)
    taskset, max_turns = _taskset_of(vf, loaded, what)
    name = type(taskset).__name__
    if not taskset.bounded:
        raise InputError(
            f"{what}: {name} is infinite; bound it in load_environment() (taskset.take(n))"
        )
    task_cls = type(taskset).task_type()
    shared = list(type(taskset).toolsets(taskset.config))
    tasks = list(taskset)
    if not tasks:
        raise InputError(f"{what}: {name} has no tasks")
    for server in shared:
        _check_toolset(vf, server, f"{what}: {name}.toolsets")
    rows = _task_rows(vf, tasks, what)

    from peergrade.tasks import load_task

    task = load_task("file", data=rows)
    task.name = f"verifiers:{target}"
    task.default_rewards = [(verifiers_reward, 1.0)]
    by_idx = {t.data.idx: t for t in tasks}
    agent_config = loaded.config.agent if isinstance(loaded, vf.Env) else vf.AgentConfig()
    ready: set[int] = set()  # the taskset-wide servers already set up

    def make(row: Any) -> VerifiersEnvironment:
        data = row.get(COLUMN) if isinstance(row, dict) else None
        if not isinstance(data, dict):
            raise InputError(f"row {row!r}: expected the verifiers task data in {COLUMN!r}")
        # the loaded task (its own config) when the row is one of the taskset's, else rebuilt
        t = by_idx.get(data.get("idx"))
        if t is None or t.data.model_dump(mode="json") != data:
            t = task_cls(task_cls.data_type().model_validate(data), taskset.config.task)
        else:
            t = t.with_data()  # a copy per episode
        env = VerifiersEnvironment(vf, t, shared, agent_config, max_turns, ready)
        env.timeout, env.max_chars = tool_timeout, max_tool_output_chars
        env.tool_format = make.tool_format
        return env

    make.tool_format = "hermes"  # the chat template's call format (envs.tools.parse_tool_calls)
    make.task = task
    make.environment_class = None
    return make


def _call_loader(load_environment: Callable, what: str) -> Any:
    """What the module's ``load_environment()`` returns; anything it raises (but peergrade's
    own errors) as one ``InputError`` on one line."""
    try:
        return load_environment()
    except PeergradeError:
        raise
    except Exception as e:
        detail = " ".join(str(e).split())  # one line: a pydantic error spans several
        raise InputError(f"{what}: load_environment() raised {type(e).__name__}: {detail}") from e


def _taskset_of(vf, loaded: Any, what: str) -> tuple[Any, int | None]:
    """The taskset of what ``load_environment()`` returned and the agent's ``max_turns`` (None
    for a bare taskset); a multi-agent ``Env`` or a harness other than ``null`` is refused."""
    if isinstance(loaded, vf.Env):
        if (
            not isinstance(loaded, vf.SingleAgentEnv)
            or type(loaded).run is not vf.SingleAgentEnv.run
        ):
            raise InputError(
                f"{what}: {type(loaded).__name__} is a multi-agent verifiers Env (its own run()); "
                "peergrade trains one agent per episode: return a vf.SingleAgentEnv or a vf.Taskset"
            )
        agent = loaded.config.agent
        harness = agent.harness
        if harness is not None and harness.id != "null":
            raise InputError(
                f"{what}: the agent's harness is {harness.id!r}, whose program and tools run in a "
                f"sandbox runtime ({type(agent.runtime).__name__}); peergrade runs the plain chat "
                "loop only: pin harness id 'null' (vf.AgentConfig(harness={'id': 'null'}))"
            )
        max_turns = agent.max_turns
        return loaded.taskset, max_turns
    if isinstance(loaded, vf.Taskset):
        return loaded, None
    raise InputError(
        f"{what}: load_environment() returned a {type(loaded).__name__}; expected a "
        "vf.SingleAgentEnv or a vf.Taskset"
    )


def _task_rows(vf, tasks: list, what: str) -> list[dict]:
    """The peergrade rows of ``tasks`` (the prompt, and the task's data in ``COLUMN``), each
    task checked first (``_check_task``, once per task config; no container; a prompt)."""
    rows, checked = [], set()
    for task in tasks:
        where = f"{what}: task {task.data.idx} ({task.data.name or task.key[:12]})"
        if id(task.config) not in checked:  # tasks usually share the taskset's task config
            _check_task(vf, task, where)
            checked.add(id(task.config))
        if task.NEEDS_CONTAINER or task.data.image:
            raise InputError(
                f"{where} needs a container (NEEDS_CONTAINER / image {task.data.image!r}), a "
                "sandbox peergrade does not run"
            )
        if task.data.prompt is None:
            raise InputError(
                f"{where} has no prompt (a simulated user opens it); peergrade needs the "
                "task's prompt"
            )
        rows.append({"prompt": _prompt(task.data), COLUMN: task.data.model_dump(mode="json")})
    return rows


def _check_toolset(vf, server: Any, where: str) -> None:
    cfg = getattr(server, "config", None)
    if getattr(cfg, "url", None):
        raise InputError(
            f"{where}: {type(server).__name__} is a hosted service ({cfg.url}); peergrade runs "
            "Python Toolsets in its own process only"
        )
    runtime = getattr(cfg, "runtime", None)
    if runtime is not None and not isinstance(runtime, vf.SubprocessConfig):
        raise InputError(
            f"{where}: {type(server).__name__} runs in a {type(runtime).__name__} runtime (a "
            "remote sandbox or container); peergrade runs Python Toolsets in its own process only"
        )


def _check_task(vf, task: Any, where: str) -> None:
    """What a task class needs that cannot run here (the module docstring's list)."""
    for hook in ("setup", "finalize"):
        if getattr(type(task), hook) is not getattr(vf.Task, hook):
            raise InputError(
                f"{where} overrides {hook}(trace, runtime), which works in the task's sandbox "
                "runtime; peergrade runs no runtime"
            )
    if task.config.judges:
        raise InputError(
            f"{where} has judges ({', '.join(j.id for j in task.config.judges)}), which call a "
            "judge model served over the network; peergrade trains without network models"
        )
    for kind in ("reward", "metric"):
        for fn in task.hooks(kind):
            p = inspect.signature(fn).parameters.get("runtime")
            if p is not None and p.default is inspect.Parameter.empty:
                raise InputError(
                    f"{where}: @vf.{kind} {fn.__name__} needs the sandbox runtime; peergrade runs "
                    "no runtime"
                )
    if any(True for _ in _decorated(task, "intercept")):
        raise InputError(
            f"{where} has @vf.intercept hooks, which rewrite the model's turns; peergrade "
            "trains on the tokens the model sampled and cannot rewrite them"
        )
    for server in type(task).toolsets(task.config):
        _check_toolset(vf, server, f"{where}.toolsets")


def _decorated(task: Any, attr: str):
    return (
        n
        for k in type(task).__mro__
        for n, f in vars(k).items()
        if callable(f) and hasattr(f, attr)
    )


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(getattr(p, "text", "") for p in content or [] if getattr(p, "text", None))


def _prompt(data: Any) -> str | list[dict]:
    """A task's opening as peergrade's ``prompt`` column: its text, or its messages."""
    if isinstance(data.prompt, str):
        return data.prompt
    return [{"role": m.role, "content": _text(m.content)} for m in data.prompt]


def _hook_kinds(vf, fn) -> dict[str, type]:
    """A hook's parameters by the verifiers type they are annotated with (verifiers passes hook
    arguments by annotation, not by name)."""
    hints = get_type_hints(fn)
    return {
        name: kind
        for name, hint in hints.items()
        for kind in (vf.Trace, vf.Request, vf.Response)
        if name != "return" and isinstance(hint, type) and issubclass(hint, kind)
    }


async def _stop_fired(vf, hooks: list, values: dict[type, Any]) -> str | None:
    """The name of the first stop hook (in verifiers' priority order) that returns True."""
    for fn in hooks:
        kinds = _hook_kinds(vf, fn)
        result = fn(**{name: values[kind] for name, kind in kinds.items() if kind in values})
        if inspect.isawaitable(result):
            result = await result
        if not isinstance(result, bool):
            raise TypeError(f"@vf.stop {fn.__name__} must return bool, got {type(result).__name__}")
        if result:
            return fn.__name__
    return None


class VerifiersEnvironment:
    """One episode of a verifiers task in the native protocol (see the module docstring)."""

    tool_format = "hermes"  # the chat template's call format (set by ``load_verifiers``'s make)

    def __init__(
        self, vf, task, shared: list, agent_config, max_turns: int | None, ready: set[int]
    ):
        self.vf, self.task, self.ready = vf, task, ready
        self.shared, self.agent_config, self.max_turns = shared, agent_config, max_turns
        self.tools: list[dict] | None = None
        self.timeout: float | None = None  # env.tool_timeout (load_verifiers sets them)
        self.max_chars: int | None = None  # env.max_tool_output_chars
        self.trace = None
        self._reward: float | None = None
        # verifiers runs a stop on the Response after a model turn, else before the next turn
        self._stops: dict[str, list] = {"before": [], "after": []}
        for fn in task.hooks("stop"):
            kinds = set(_hook_kinds(vf, fn).values())
            self._stops["after" if vf.Response in kinds else "before"].append(fn)

    async def _serve_tools(self) -> None:
        from mcp.server.mcpserver import MCPServer

        self.registry: dict[str, Callable] = {}
        schemas = []
        own = type(self.task).toolsets(self.task.config)  # fresh servers for this episode
        for server in [*self.shared, *own]:
            if server in own:
                await server.setup()
                await server.setup_task(self.task)  # taskset-wide servers skip it, as in verifiers
            elif id(server) not in self.ready:
                await server.setup()
                self.ready.add(id(server))
            mcp = MCPServer(server.server_name or type(server).__name__)
            server.register(mcp)
            for tool in await mcp.list_tools():
                full = f"{server.server_name}_{tool.name}" if server.server_name else tool.name
                self.registry[full] = self._caller(mcp, tool.name)
                schemas.append(
                    {
                        "type": "function",
                        "function": {
                            "name": full,
                            "description": tool.description or "",
                            "parameters": tool.input_schema,
                        },
                    }
                )
        self.tools = schemas or None

    @staticmethod
    def _caller(mcp, name: str) -> Callable:
        async def call(**arguments):
            result = await mcp.call_tool(name, arguments)
            text = _text(result.content)
            if result.is_error:
                raise RuntimeError(text or f"tool {name} failed")
            return text

        return call

    def _add(self, message: dict | Any, sampled: bool = False) -> None:
        from pydantic import TypeAdapter

        vf = self.vf
        if isinstance(message, dict):
            message = TypeAdapter(vf.Message).validate_python(message)
        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(vf.MessageNode(parent=parent, message=message, sampled=sampled))

    async def reset(self, row: dict) -> list[dict]:
        vf, task = self.vf, self.task
        await self._serve_tools()
        data = task.data
        messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        prompt = _prompt(data)
        messages += [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        self.trace = vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=data, key=task.key, hash=task.hash),
            agent=vf.AgentInfo(config=self.agent_config),
            tools=[
                vf.Tool(
                    name=t["function"]["name"],
                    description=t["function"]["description"],
                    parameters=t["function"]["parameters"],
                )
                for t in self.tools or []
            ],
        )
        for m in messages:
            self._add(m)
        return messages

    def _end(self, condition: str, messages: list | None = None, **counts) -> Step:
        self.trace.stop(condition)
        reason = "answer" if condition == "agent_completed" else condition
        return Step(messages=messages or [], done=True, finish_reason=reason, **counts)

    async def step(self, message: dict) -> Step:
        vf = self.vf
        content, calls, errors = parse_tool_calls(message["content"], self.tool_format)
        ids = [f"call_{uuid.uuid4().hex[:12]}" for _ in calls]
        reply = vf.AssistantMessage(
            content=content if calls or errors else message["content"],
            tool_calls=[
                vf.ToolCall(
                    id=i,
                    name=c["function"]["name"],
                    arguments=json.dumps(c["function"]["arguments"]),
                )
                for i, c in zip(ids, calls)
            ]
            or None,
        )
        self._add(reply, sampled=True)
        response = vf.Response(
            id=uuid.uuid4().hex,
            created=int(time.time()),
            model="peergrade",
            message=reply,
            finish_reason="tool_calls" if calls else "stop",
        )
        fired = await _stop_fired(
            vf, self._stops["after"], {vf.Response: response, vf.Trace: self.trace}
        )
        if fired:
            return self._end(fired)
        if not calls and not errors:
            return self._end("agent_completed")
        message["content"] = content
        if calls:
            message["tool_calls"] = calls
        results = await _call_tools(calls, self.registry, self.timeout)
        answers = []
        for call_id, (name, result, failed) in zip(ids, results):
            text = str(result) if failed else _truncate(str(result), self.max_chars)
            answers.append({"role": "tool", "name": name, "content": text})
            self._add(vf.ToolMessage(tool_call_id=call_id, name=name, content=text))
        for e in errors:
            answers.append(
                {"role": "tool", "name": "invalid_tool_call", "content": str({"error": e})}
            )
        counts = dict(
            tool_calls=len(calls) + len(errors),
            tool_failures=sum(f for _, _, f in results) + len(errors),
        )
        # verifiers checks its limits and stops before the next model call
        if self.max_turns is not None and self.trace.num_turns >= self.max_turns:
            return self._end("max_turns", answers, **counts)
        request = vf.Request(messages=self.trace.messages, tools=self.trace.tools or None)
        fired = await _stop_fired(
            vf, self._stops["before"], {vf.Request: request, vf.Trace: self.trace}
        )
        if fired:
            return self._end(fired, answers, **counts)
        return Step(messages=answers, **counts)

    async def get_reward(self) -> float:
        """The task's rewards on this episode's trace (``Task.score``), computed once."""
        if self._reward is None:
            if not self.trace.is_completed:  # cut by a peergrade budget
                self.trace.stop("length")
            await self.task.score(self.trace)
            self._reward = self.trace.reward
        return self._reward


def verifiers_reward(completions, environments, log_metric=None, **kwargs) -> list[float]:
    """The verifiers task's reward of each episode: ``trace.reward``, the weighted sum of its
    ``@vf.reward`` functions (``Task.score`` on the episode's trace). The task's ``@vf.metric``
    values (``trace.metrics``) go to metrics.jsonl as ``verifiers/<name>``, averaged over the
    episodes that have one."""
    bad = [type(e).__name__ for e in environments if not isinstance(e, VerifiersEnvironment)]
    if bad:
        raise ValueError(f"verifiers_reward scores verifiers episodes only, got {bad[0]}")

    async def all_of():
        return await asyncio.gather(*(e.get_reward() for e in environments))

    rewards = [float(r) for r in run_sync(all_of())]
    if log_metric is not None:
        for e in environments:
            for name, value in (getattr(e.trace, "metrics", None) or {}).items():
                if value is not None:
                    log_metric(f"verifiers/{name}", value)
    return rewards
