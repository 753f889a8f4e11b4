"""Loading: the YAML file (and its ``base:`` chain), command-line overrides, relative paths
made absolute, and every key and value checked against the tree (an unknown key names the
closest valid one) -- then ``validate`` (``config.validate``)."""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from peergrade.config.schema import Config
from peergrade.config.sections import RewardItem
from peergrade.config.validate import validate
from peergrade.errors import ConfigError
from peergrade.files import PYTHON_ONLY

# ----------------------------------------------------------------------------- type checking


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        return f"list of {_type_name(arg)}"
    if origin is dict:
        return "mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp``; return it (ints widened to float where asked)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and ("on" if value else "off") in choices:
            # YAML 1.1 (and so a YAML file or a command-line value) reads `off`/`on` as
            # booleans; where 'off'/'on' is a choice, that is what was written
            return "on" if value else "off"
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{key}: {value!r} is not allowed; choose one of {', '.join(map(repr, choices))}{hint}"
            )
        return value
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{key}: expected null, got {value!r}")
        return None
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        if arg is RewardItem and not isinstance(value, list):
            raise ConfigError(
                f"{key}: expected a list of rewards, e.g. [my_rewards.py:my_reward, format=0.2] "
                f"or [{{name: my_rewards.py:my_reward, weight: 1.0}}], got {value!r}"
            )
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        if arg is RewardItem:
            return [
                _build(arg, _reward_mapping(v, f"{key}[{i}]"), f"{key}[{i}]")
                for i, v in enumerate(value)
            ]
        if dataclasses.is_dataclass(arg):
            return [_build(arg, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return [_coerce(v, arg, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            # PyYAML reads `1e-5` (no dot) as a string (YAML 1.1); accept what float() accepts.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    raise ConfigError(f"{key}: unsupported type {tp!r}")  # pragma: no cover - programming error


def reward_item(spec: str, key: str = "--reward") -> dict:
    """A reward's short form -> a ``rewards`` item: ``name``, ``name=0.5`` (with its weight),
    ``my_rewards.py:my_reward=2`` (the ``--reward`` syntax, also accepted in a YAML list)."""
    name, weight = spec, 1.0
    if "=" in spec:
        name, w = spec.rsplit("=", 1)
        try:
            weight = float(w)
        except ValueError:
            raise ConfigError(f"{key} {spec!r}: the weight after '=' must be a number") from None
    return {"name": name, "weight": weight}


def _reward_mapping(value: Any, key: str) -> Any:
    """A ``rewards`` list entry as a mapping: the short string form is expanded."""
    if isinstance(value, str):
        return reward_item(value, key)
    if not isinstance(value, dict):
        raise ConfigError(
            f"{key}: expected a reward name such as 'my_rewards.py:my_reward' or a mapping such "
            f"as {{name: my_rewards.py:my_reward, weight: 1.0}}, got {value!r}"
        )
    return value


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unknown_key(cls, name: str, prefix: str) -> ConfigError:
    valid = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    full = f"{prefix}{name}"
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
    return ConfigError(
        f"unknown config key '{full}'{hint} (valid keys here: {', '.join(prefix + v for v in valid)})"
    )


def _build(cls, data: Any, key: str = ""):
    """Instantiate dataclass ``cls`` from a (possibly partial) mapping, checking every key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{key or 'config'}: expected a mapping, got {data!r}")
    hints = _hints(cls)
    prefix = f"{key}." if key else ""
    kwargs = {}
    for name, value in data.items():
        if name not in hints:
            raise _unknown_key(cls, str(name), prefix)
        kwargs[name] = _coerce(value, hints[name], f"{prefix}{name}")
    return cls(**kwargs)


# ----------------------------------------------------------------------------- loading


def _deep_merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        if (
            isinstance(v, dict)
            and isinstance(out.get(k), dict)
            and k not in ("task_options", "columns", "kwargs")
        ):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_override_value(text: str) -> Any:
    """Parse a command-line value as YAML (``0.04`` -> float, ``[a, b]`` -> list, ``null``).

    A mapping or list must be written as one (``{k: v}``, ``[a, b]``, or YAML block text): a
    sentence such as ``Answer like this: <answer>7</answer>`` stays the string it is."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    one_line_sentence = "\n" not in text and not text.lstrip().startswith(("{", "[", "-"))
    if isinstance(value, (dict, list)) and one_line_sentence:
        return text  # e.g. "Answer: 42", not a YAML document
    return value


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    """Set ``tree['a']['b'] = value`` for ``dotted == 'a.b'``, checking each key exists."""
    parts = dotted.split(".")
    cls: Any = Config
    node = tree
    for i, part in enumerate(parts):
        prefix = ".".join(parts[:i])
        prefix = prefix + "." if prefix else ""
        hints = _hints(cls)
        if part not in hints:
            raise _unknown_key(cls, part, prefix)
        if i == len(parts) - 1:
            node[part] = value
            return
        tp = hints[part]
        if typing.get_origin(tp) is dict or tp is Any:
            # free-form mapping (task_options, columns, kwargs): the rest of the path is a key
            sub = node.setdefault(part, {}) or {}
            node[part] = sub
            sub[".".join(parts[i + 1 :])] = value
            return
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(
                f"config key '{prefix}{part}' is a value, not a section: cannot set '{dotted}'"
            )
        node = node.setdefault(part, {})
        cls = tp


#: keys whose value is a file or directory the run reads (rewards' names are handled apart)
PATH_KEYS = ("model.path", "data.path", "data.eval_path", "algo.critic_path", "algo.teacher_path")


def _split_path(key: str, value: Any) -> tuple[str, str] | None:
    """(the local path inside ``value``, what follows it) when ``value`` of ``key`` names a path
    to resolve; None for model names (``bundled``, ``pypi:NAME``), built-in reward names and
    ``module:function``."""
    if not isinstance(value, str) or not value.strip() or value.startswith(PYTHON_ONLY):
        return None
    value = value.strip()
    if key == "env.factory" and value.startswith("verifiers:"):
        target = value[len("verifiers:") :].strip()
        if target.endswith(".py") or "/" in target or "\\" in target:
            return target, ""  # verifiers:path/to/file.py (the prefix is put back by the caller)
        return None  # verifiers:MODULE
    if key.startswith(("env.tools[", "env.factory", "harness.fn")):
        target, sep, attr = value.rpartition(":")
        if sep and (target.endswith(".py") or "/" in target or "\\" in target):
            return target, sep + attr  # path/to/file.py:name
        return None  # module:name
    if key.startswith("rewards["):
        target, sep, attr = value.rpartition(":")
        if sep and (target.endswith(".py") or "/" in target or "\\" in target):
            return target, sep + attr  # path/to/file.py:function
        if not sep and ("/" in value or value.startswith(("~", "."))):
            return value, ""  # a reward-model directory, written as a path
        return None
    if key in ("model.path", "algo.critic_path", "algo.teacher_path") and (
        value == "bundled" or value.startswith(("pypi:", "bundled:"))
    ):
        return None
    return value, ""


def _resolve_paths(tree: dict, base: Path, given: dict[str, str]) -> None:
    """Make the relative paths of ``tree`` (one YAML file's mapping, or the command line's
    overrides) absolute against ``base`` in place; record each as typed in ``given``. Whether
    they exist is for their loaders to say (with the absolute path): ``peergrade config`` prints
    a config whose data is not there yet."""
    found: list[tuple[str, dict, str]] = []  # (key, the mapping holding it, its field)
    for dotted in PATH_KEYS:
        section, name = dotted.split(".")
        node = tree.get(section)
        if isinstance(node, dict) and name in node:
            found.append((dotted, node, name))
    rewards = tree.get("rewards")
    if isinstance(rewards, list):
        for key in [k for k in given if k.startswith("rewards[")]:
            del given[key]  # a new list replaces the old one, items and all
        for i, item in enumerate(rewards):
            if isinstance(item, str):  # the short form, expanded here to hold the absolute path
                item = rewards[i] = reward_item(item, f"rewards[{i}]")
            if isinstance(item, dict) and "name" in item:
                found.append((f"rewards[{i}].name", item, "name"))
    harness = tree.get("harness")
    if isinstance(harness, dict) and "fn" in harness:
        found.append(("harness.fn", harness, "fn"))
    env = tree.get("env")
    if isinstance(env, dict):
        if "factory" in env:
            found.append(("env.factory", env, "factory"))
        if isinstance(env.get("tools"), list):
            for key in [k for k in given if k.startswith("env.tools[")]:
                del given[key]  # as for rewards: a new list replaces the old one
            found += [(f"env.tools[{i}]", env["tools"], i) for i in range(len(env["tools"]))]
    for key, node, name in found:
        given.pop(key, None)  # an earlier value's typed form no longer applies
        parts = _split_path(key, node[name])
        if parts is None:
            continue
        path, rest = parts
        prefix = "verifiers:" if node[name].strip().startswith("verifiers:") else ""
        expanded = Path(path).expanduser()
        node[name] = prefix + os.path.abspath(base / expanded) + rest
        if not expanded.is_absolute():
            given[key] = prefix + path + rest


def _read_tree(
    p: Path,
    seen: tuple[Path, ...] = (),
    given: dict[str, str] | None = None,
    relative_to: Path | None = None,
) -> dict:
    """The mapping in YAML file ``p``, its relative paths made absolute against ``p``'s folder
    (or ``relative_to``); a top-level ``base: other.yaml`` (relative to ``p``) is read first and
    ``p``'s own values are merged over it."""
    if not p.is_file():
        where = f" (the base of {str(seen[-1])!r})" if seen else ""
        raise ConfigError(f"config file {str(p)!r}{where} does not exist")
    if p.resolve() in seen:
        chain = " -> ".join(str(x) for x in (*seen, p.resolve()))
        raise ConfigError(f"config file {str(p)!r}: 'base' files form a cycle: {chain}")
    try:
        loaded = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(p)!r}: expected a mapping at the top level")
    base = loaded.pop("base", None)
    given = {} if given is None else given
    # a run's config.yaml records how its (now absolute) paths were typed
    recorded = loaded.pop("given_paths", None) or {}
    if not isinstance(recorded, dict):
        raise ConfigError(f"config file {str(p)!r}: 'given_paths' must be a mapping")
    if base is None:
        _resolve_paths(loaded, relative_to or p.parent, given)
        given.update({str(k): str(v) for k, v in recorded.items()})
        return loaded
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"config file {str(p)!r}: 'base' must be a YAML file path, got {base!r}")
    parent = _read_tree(p.parent / base, (*seen, p.resolve()), given)
    _resolve_paths(loaded, p.parent, given)  # after the base's: they win
    return _deep_merge(parent, loaded)


def load_config(
    path: str | Path | None = None,
    overrides: list[tuple[str, Any]] | None = None,
    *,
    relative_to: str | Path | None = None,
) -> Config:
    """Defaults <- YAML file (and its ``base:`` chain) <- overrides ``[("algo.beta", 0.04),
    ...]``; then ``validate``. Relative paths are made absolute: the file's against its folder
    (``relative_to``: against that directory instead, e.g. the working directory for a run's
    config.yaml written before paths were stored absolute), the overrides' against the
    working directory."""
    given: dict[str, str] = {}
    where = Path(relative_to) if relative_to is not None else None
    tree: dict = _read_tree(Path(path), (), given, where) if path is not None else {}
    for dotted, value in overrides or []:
        patch: dict = {}
        _set_path(patch, dotted, value)
        _resolve_paths(patch, Path.cwd(), given)
        tree = _deep_merge(tree, patch)
    cfg = _build(Config, tree)
    if cfg.data.path is not None:
        cfg.data.task = "file"  # what is used: the saved config.yaml says so
    validate(cfg)
    cfg.given_paths = given  # a plain dict: a Config is deep-copied (memory, sweep)
    return cfg


def load_run_config(path: str | Path, overrides: list[tuple[str, Any]] | None = None) -> Config:
    """A run's (or checkpoint's) config.yaml: its paths are absolute; one written before they
    were holds them as typed, relative to where the run was started, taken to be the working
    directory."""
    return load_config(path, overrides, relative_to=Path.cwd())
