"""What ``--tools FILE:fn`` and ``--env FILE:Class`` name, loaded and checked: the
``make_env`` that ``run_episodes`` takes.

``make_env_from_specs(tools=["my_tools.py:multiply"], env="my_env.py:Game")`` loads each name
(``path/to/file.py:name`` or an importable ``module:name``, resolved as reward functions are)
and returns a ``row -> environment`` factory:

- an ``env`` class with a ``step`` method is a native environment (``protocol``): one instance
  per episode; ``tools`` must then be empty (a native environment runs its own tools);
- any other ``env`` class is TRL's ``environment_factory`` (``reset(**row)``, public methods as
  tools), combined with the ``tools`` functions through ``tools.tool_environment_factory``;
- no ``env``: the ``tools`` alone;
- ``env`` = ``verifiers:MODULE``: a verifiers environment (``envs.verifiers``), whose factory
  also carries the task (rows and reward) the trainer uses instead of ``data:``.

``make_env_from_objects(tools=[multiply], env=Game)`` does the same from the objects
themselves (the Python API's ``tools=`` / ``environment_factory=``). ``reference_of(obj)`` is
how the run's config.yaml records such an object: ``module:name`` when importing that name
gives the object back (a command-line ``--resume`` then loads it), else a
``python-object:...`` marker that ``load_object`` refuses with an error saying to resume from
Python with the same objects.

Everything is checked here, before a model loads (the trainer calls this from ``env:`` /
``--tools`` / ``--env`` first thing). The factory's ``environment_class`` attribute is the
``env`` class (or None), for the trainer to see whether it gives a reward of its own.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

from peergrade.envs.tools import tool_environment_factory
from peergrade.envs.verifiers import is_verifiers_spec, load_verifiers
from peergrade.errors import InputError, PeergradeError
from peergrade.files import PYTHON_ONLY  # a tool or class given from Python, not importable


def reference_of(obj: Any) -> str:
    """``module:name`` of a function or class given from Python when importing it by that name
    gives the same object (so a later ``peergrade train --resume`` loads it); otherwise (defined
    in ``__main__`` or inside a function, a lambda, a dict of classes) ``PYTHON_ONLY`` and a
    description, which ``load_object`` refuses with a clear error."""
    if isinstance(obj, dict):
        return (
            PYTHON_ONLY + "{" + ", ".join(f"{k}: {reference_of(v)}" for k, v in obj.items()) + "}"
        )
    module = getattr(obj, "__module__", None)
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    ref = f"{module}:{name}" if module and name else repr(obj)
    # a plain top-level name: load_object resolves 'module:name', not dotted paths
    if module and name and module != "__main__" and name.isidentifier():
        try:
            if getattr(importlib.import_module(module), name, None) is obj:
                return ref
        except Exception:  # an unimportable module: recorded as a marker, never a failure here
            pass
    return PYTHON_ONLY + ref


def load_object(spec: str, what: str) -> Any:
    """The object named by ``path/to/file.py:name`` or ``module:name``; ``what`` names the
    flag or key in errors. A ``PYTHON_ONLY`` marker is an InputError."""
    from peergrade.rewards.registry import _import_attr, _load_file

    if isinstance(spec, str) and spec.startswith(PYTHON_ONLY):
        raise InputError(
            f"{what} {spec!r}: this run was given that object from Python "
            "(GRPOTrainer(tools=..., environment_factory=...)) and it cannot be imported by name "
            "(defined in __main__, inside a function, or a lambda), so it cannot be loaded "
            "here; resume the run from Python with the same tools and environment_factory: "
            "GRPOTrainer(..., tools=[...], environment_factory=...)"
            ".train(resume_from_checkpoint=RUN_DIR)"
        )
    if not isinstance(spec, str) or spec.count(":") < 1 or not all(spec.rsplit(":", 1)):
        raise InputError(f"{what} {spec!r}: expected 'path/to/file.py:name' or 'module:name'")
    target, attr = spec.strip().rsplit(":", 1)
    try:
        if target.endswith(".py") or "/" in target or "\\" in target:
            return _load_file(target, attr, what=f"{what} {spec!r}")
        return _import_attr(target, attr, what=f"{what} {spec!r}")
    except PeergradeError:
        raise
    except ValueError as e:  # a missing file or name: the message already says which
        raise InputError(str(e)) from e


def make_env_from_specs(
    tools: Sequence[str] = (), env: str | None = None, **options: Any
) -> Callable[[Any], Any]:
    """A checked ``row -> environment`` factory from ``--tools`` / ``--env`` names (see the
    module docstring); ``options`` go to ``tool_environment_factory``
    (``max_tool_calling_iterations``, ``tool_timeout``, ``max_tool_output_chars``)."""
    if is_verifiers_spec(env):
        if tools:
            raise InputError(
                f"--env {env!r} is a verifiers environment: its Toolsets are its tools; "
                "--tools cannot be added to it"
            )
        return load_verifiers(
            env,
            tool_timeout=options.get("tool_timeout"),
            max_tool_output_chars=options.get("max_tool_output_chars"),
        )
    fns = [load_object(s, "--tools") for s in tools]
    cls = load_object(env, "--env") if env else None
    return make_env_from_objects(
        fns, cls, names=("--tools", f"--env {env!r}" if env else "--env"), **options
    )


def make_env_from_objects(
    tools: Sequence[Callable] = (),
    env: Any = None,
    *,
    names: tuple[str, str] = ("tools", "environment_factory"),
    **options: Any,
) -> Callable[[Any], Any]:
    """The same checked factory from the objects themselves (the Python API's ``tools=`` and
    ``environment_factory=``); ``names`` say how errors call the tools and the class."""
    fns, cls = list(tools), env
    tools_name, env_name = names
    if cls is not None and not isinstance(cls, dict) and callable(getattr(cls, "step", None)):
        if fns:
            raise InputError(
                f"{env_name} is a native environment (it has step); it cannot take {tools_name} "
                "functions as well: call them from its step, or give a TRL environment_factory "
                "class (reset and tool methods, no step)"
            )
        if not callable(getattr(cls, "reset", None)):
            raise InputError(
                f"{env_name}: {cls.__name__} has step but no reset method; a native environment "
                "needs reset(row) -> opening messages and step(assistant_message) -> Step"
            )
        make = lambda row: cls()  # noqa: E731
    elif cls is None and not fns:
        raise InputError(f"an episode needs {env_name} or at least one {tools_name} function")
    else:
        make = tool_environment_factory(fns, cls, **options)
    make.environment_class = cls
    make.tool_schemas = _tool_schemas(fns, cls)
    return make


def _tool_schemas(fns: list, cls: Any) -> list[dict]:
    """The tool schemas the episodes pass to the chat template, known before any environment
    is made: the functions', an environment class's public methods', or a native environment
    class's ``tools`` attribute (empty where only an instance knows them)."""
    from peergrade.envs.tools import _public_methods, tool_schema

    classes = list(cls.values()) if isinstance(cls, dict) else [cls] if cls is not None else []
    out = [tool_schema(fn) for fn in fns]
    for c in classes:
        if not isinstance(c, type):
            continue
        if callable(getattr(c, "step", None)):  # native: its own schemas, if the class has them
            tools = getattr(c, "tools", None)
            out += [t for t in tools if isinstance(t, dict)] if isinstance(tools, list) else []
        else:
            out += [tool_schema(getattr(c, n)) for n in _public_methods(c)]
    return out
