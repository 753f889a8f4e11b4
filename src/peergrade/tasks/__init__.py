"""Tasks: built-in problem generators and user dataset loaders behind one ``load_task`` call.

``load_task(name, **options) -> Task``:

- ``"arithmetic"``: seeded ``a op b`` problems (``peergrade.tasks.arithmetic``).
- ``"countdown"``: seeded countdown equations (``peergrade.tasks.countdown``).
- ``"logic"``: any ``reasoning-gym`` dataset by ``dataset=...`` (``peergrade.tasks.logic``).
- ``"file"`` with ``path=...``, or directly a path ending in ``.jsonl``/``.json``/``.csv``/
  ``.parquet`` or a local Hugging Face ``datasets`` directory (``peergrade.tasks.files``).

Every task yields plain-dict rows (see ``Task``); ``render_prompt`` applies a tokenizer's chat
template. Task modules are imported only when named, so a missing optional dependency only
matters to the task that needs it.

This package does not score completions (``peergrade.rewards`` does).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from pathlib import Path

from .base import Task
from .prompts import render_prompt

__all__ = [
    "BUILTIN_TASKS",
    "FILE_SUFFIXES",
    "Task",
    "available_tasks",
    "load_task",
    "render_prompt",
]

#: task name -> "module:class" (imported when the task is loaded)
BUILTIN_TASKS: dict[str, str] = {
    "arithmetic": "peergrade.tasks.arithmetic:ArithmeticTask",
    "countdown": "peergrade.tasks.countdown:CountdownTask",
    "logic": "peergrade.tasks.logic:LogicTask",
    "file": "peergrade.tasks.files:FileTask",
}
FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def available_tasks() -> list[str]:
    """The names ``load_task`` accepts (besides a dataset path)."""
    return sorted(BUILTIN_TASKS)


def _looks_like_path(name: str) -> bool:
    if name.lower().endswith(FILE_SUFFIXES):
        return True
    if "/" in name or "\\" in name or name.startswith("."):
        return True
    return Path(name).is_dir()


def load_task(name: str, **options) -> Task:
    """The task called ``name`` (or the dataset at path ``name``) built with ``options``."""
    if isinstance(name, Path):
        name = str(name)
    if not isinstance(name, str) or not name.strip():
        raise ValueError(
            f"task must be a name ({', '.join(available_tasks())}) or a path, got {name!r}"
        )
    name = name.strip()
    if name not in BUILTIN_TASKS and _looks_like_path(name):
        if "path" in options:
            raise ValueError(f"task {name!r} is a path already; do not also pass path=")
        options["path"] = name
        name = "file"
    if name not in BUILTIN_TASKS:
        close = difflib.get_close_matches(name, available_tasks(), n=1, cutoff=0.5)
        raise ValueError(
            f"unknown task {name!r}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f". Valid tasks: {', '.join(available_tasks())}, or a dataset path ending in "
            + ", ".join(FILE_SUFFIXES)
            + " or a local Hugging Face datasets directory"
        )
    module_name, cls_name = BUILTIN_TASKS[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    params = inspect.signature(cls.__init__).parameters
    valid = [p for p, v in params.items() if p != "self" and v.kind != v.VAR_KEYWORD]
    if not any(v.kind == v.VAR_KEYWORD for v in params.values()):
        for option in options:
            if option not in valid:
                close = difflib.get_close_matches(option, valid, n=1, cutoff=0.5)
                raise ValueError(
                    f"task {name!r} has no option {option!r}"
                    + (f" (did you mean {close[0]!r}?)" if close else "")
                    + f"; its options are {', '.join(valid)}"
                )
    return cls(**options)
