"""``recorded``: wraps a reward function so that each call appends what it received (argument
names, the form of prompts and completions, the trainer state, the dataset columns) as one
JSON line to the file named by ``$PEERGRADE_COMPAT_LOG``; the function itself runs unchanged
(its own signature still checks the call)."""

from __future__ import annotations

import functools
import inspect
import json
import os
from pathlib import Path


def _form(x) -> str:
    if isinstance(x, str):
        return "text"
    if isinstance(x, list) and all(
        isinstance(m, dict) and set(m) == {"role", "content"} for m in x
    ):
        return "messages:" + ",".join(m["role"] for m in x)
    return type(x).__name__


def _record(fn, kwargs: dict) -> None:
    st = kwargs.get("trainer_state")
    prompts, completions = kwargs.get("prompts", []), kwargs.get("completions", [])
    entry = {
        "fn": f"{Path(inspect.getfile(fn)).stem}.{fn.__name__}",  # file stem: recipes_a.name
        "keys": sorted(kwargs),
        "n": len(completions),
        "prompt_forms": sorted({_form(p) for p in prompts}),
        "completion_forms": sorted({_form(c) for c in completions}),
        "completion_text_ok": all(
            isinstance(c, str) or isinstance(c[0]["content"], str) for c in completions
        ),
        "prompts": prompts,
        "completion_ids_ok": all(
            isinstance(ids, list) and all(type(t) is int for t in ids)
            for ids in kwargs.get("completion_ids", [])
        )
        and len(kwargs.get("completion_ids", [])) == len(completions),
        "trainer_state": None
        if st is None
        else {k: getattr(st, k) for k in ("global_step", "max_steps", "epoch", "num_train_epochs")},
        "log_callables": callable(kwargs.get("log_extra")) and callable(kwargs.get("log_metric")),
        "columns": {
            k: v
            for k, v in kwargs.items()
            if k
            not in (
                "prompts",
                "completions",
                "completion_ids",
                "trainer_state",
                "log_extra",
                "log_metric",
            )
        },
    }
    with open(os.environ["PEERGRADE_COMPAT_LOG"], "a") as f:
        f.write(json.dumps(entry, default=repr) + "\n")


def recorded(fn):
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def wrapper(**kwargs):
            _record(fn, kwargs)
            return await fn(**kwargs)

    else:

        @functools.wraps(fn)
        def wrapper(**kwargs):
            _record(fn, kwargs)
            return fn(**kwargs)

    return wrapper
