"""The reward-function contract, name resolution, and safe scoring of a batch.

Contract (TRL's ``GRPOTrainer``, so users bring their reward functions unchanged)::

    fn(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **columns)
        -> list[float | None]

Every argument is passed by keyword; the N-long lists are aligned with the completions:

- ``prompts``: each row's prompt as the dataset holds it (a string, or a chat message list);
- ``completions``: for a conversational row (its prompt is a message list) the completion is
  ``[{"role": "assistant", "content": text}]``; for a plain-text prompt it is the text;
- ``completion_ids``: the completion's token ids (a list of ints);
- ``trainer_state``: a ``TrainerState`` (``global_step``, ``max_steps``, ``epoch``, ... : the
  parts of ``transformers.TrainerState`` a reward reads, e.g. for a curriculum);
- ``log_extra(column, values)``: one value per completion, written into ``samples.jsonl``;
- ``log_metric(name, value)``: a scalar, averaged over the batch into ``metrics.jsonl``;
- every other dataset column (``answer``, ``tests``, ...) by its name.

The function returns one score per completion; ``None`` means "not applicable to this sample"
(excluded from that function's mean and from the weighted total). An ``async def`` function
(or one returning an awaitable) is awaited: the async functions of a batch run concurrently
(``asyncio.gather``) on one event loop that lives in a background thread for the whole process
(as TRL's), after the synchronous ones.

Resolution (``resolve_reward``): a built-in name (``BUILTIN_REWARDS``), ``module:function``
(an importable module), or ``path/to/file.py:function`` (a file, loaded under a private module
name). Built-ins are imported lazily: resolving one name imports only its module.

Names (``make_reward_specs``): a reward is logged as ``reward/<name>/...``; the name is its
``display_name`` when given (letters, digits, ``_ - .``; unique; not ``total``), else the
built-in name or the function's ``__name__`` (``functools.partial`` unwrapped), with ``_2``,
``_3``, ... appended to a name already taken (two files that both define ``accuracy``).

Scoring (``score_rewards``): each ``RewardSpec`` is called once on the whole batch with its
configured keyword arguments bound by ``functools.partial`` (a configured keyword wins over a
dataset column of the same name). A function that raises, returns something other than a
list/tuple, returns a list of the wrong length (never broadcast), or returns a value that is
not a real number finite in float32 (``|v| <= FLOAT32_MAX``: scores are stored as float32, so
1e300 is as bad as inf), is reported with the function name, the sample index and the
exception; then ``on_error="fail"`` raises ``RewardError`` and ``on_error="zero"`` scores 0
for the affected samples (for an exception or a wrong length: every sample of that call) and
counts them in ``num_errors``; what a failed function logged is dropped. When a batch call
raises, the function is called again one sample at a time, in order, until a sample raises, to
name the culprit in the report (this diagnostic only runs on failure, with logging switched
off; a function with side effects runs more than once then).

A function that could score some samples but not others raises ``RewardSampleErrors`` with
the scores it has: only the failed samples go through ``on_error``, and they are also counted
under ``reward/<fn>/<kind>`` (the code reward's ``sandbox_errors``; a function listing kinds in
its ``error_metrics`` attribute reports them every step, 0 included). An exception with
``stops_run = True`` (no sandbox for the code reward) is re-raised whatever ``on_error`` says.
A function with a ``preflight`` attribute has it called by ``make_reward_spec`` with the
configured keyword arguments, before the first step (the code reward's sandbox self-test).

The weighted total is ``total[i] = sum_f w_f * r_f[i]`` over the functions that scored sample
``i`` (``r_f[i]`` not ``None``); ``NaN`` where no function did. A function of weight 0 is logged,
not trained on: it does not count as scoring a sample (its score beside an abstaining judge
would make that sample's total 0 instead of NaN). Metrics, as TRL logs them: the
mean and the sample standard deviation (ddof = 1, TRL's ``nanstd``) over the scored samples
only, per function and for the total; a key is left out when it is undefined (no scored sample
for a mean, fewer than two for a std: JSON has no NaN).
A weighted total beyond the float32 range (each score in range, the weights too large) goes
through the same policy: ``fail`` raises, ``zero`` sets that sample's total to 0 and counts it.

This module knows nothing about tokenizers, models, or advantages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import os
import re
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from peergrade.errors import MissingPackageError, PeergradeError, describe_exit, users_own_stop
from peergrade.limits import TimeLimitExceeded, call_within

if TYPE_CHECKING:  # torch is imported when scoring, so importing this package stays light
    import torch

__all__ = [
    "BUILTIN_REWARDS",
    "CONTRACT_KWARGS",
    "RewardError",
    "RewardSampleErrors",
    "RewardScores",
    "RewardSpec",
    "TrainerState",
    "available_rewards",
    "columns_for",
    "make_reward_spec",
    "make_reward_specs",
    "required_columns",
    "resolve_reward",
    "score_rewards",
    "check_reward_options",
]

#: the keyword arguments the trainer passes besides the dataset columns (TRL's names); a
#: dataset column or a configured kwarg may not take one of these names
CONTRACT_KWARGS = (
    "prompts",
    "completions",
    "completion_ids",
    "trainer_state",
    "log_extra",
    "log_metric",
)
#: metric namespaces the trainer writes; a reward's ``log_metric`` name may not start with one
RESERVED_METRIC_PREFIXES = (
    "reward/",
    "loss/",
    "rollout/",
    "advantage/",
    "entropy/",
    "grad/",
    "optim/",
    "update/",
    "kl/",
    "clip/",
    "ratio/",
    "value/",
    "returns/",
    "time/",
    "perf/",
    "eval/",
    "curriculum/",
)
_DISPLAY_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}")

#: built-in reward name -> "module:attribute", imported only when resolved
BUILTIN_REWARDS: dict[str, str] = {
    "arithmetic": "peergrade.rewards.math:arithmetic",
    "math_accuracy": "peergrade.rewards.math:math_accuracy",
    "format": "peergrade.rewards.format:format_reward",
    "countdown": "peergrade.rewards.countdown:countdown",
    "code_tests": "peergrade.rewards.code:code_tests",
    "reasoning_gym": "peergrade.tasks.logic:reasoning_gym_reward",
    "length_penalty": "peergrade.rewards.penalties:length_penalty",
    "overlong_penalty": "peergrade.rewards.penalties:overlong_penalty",
    "repetition_penalty": "peergrade.rewards.penalties:repetition_penalty",
    "openr1_accuracy": "peergrade.rewards.openr1:openr1_accuracy",
    "openr1_format": "peergrade.rewards.openr1:openr1_format",
    "openr1_tag_count": "peergrade.rewards.openr1:openr1_tag_count",
    "openr1_reasoning_steps": "peergrade.rewards.openr1:openr1_reasoning_steps",
    "openr1_length": "peergrade.rewards.openr1:openr1_length",
    "openr1_cosine": "peergrade.rewards.openr1:openr1_cosine",
    "judge": "peergrade.rewards.judge:judge",
}


#: the largest finite float32; a score beyond it would become inf in the float32 reward tensors
FLOAT32_MAX = 3.4028234663852886e38


class RewardError(PeergradeError, RuntimeError):
    """A reward function failed (raised, wrong length, non-list, non-finite) under on_error=fail."""


class RewardSampleErrors(RewardError):
    """Raised by a reward function that could score some samples but not others.

    ``scores``: one entry per completion (the failed ones' entries are ignored); ``failed``:
    {sample index: why}; ``kind``: the metric the failures are also counted under,
    ``reward/<fn>/<kind>`` (e.g. ``sandbox_errors``). ``score_rewards`` keeps the other samples'
    scores and puts the failed ones through the ``on_error`` policy; a caller that does not know
    this class still sees a RewardError that names the failures.
    """

    def __init__(self, message: str, scores: list, failed: dict[int, str], kind: str = "errors"):
        super().__init__(message)
        self.scores = list(scores)
        self.failed = dict(failed)
        self.kind = kind


class UserFileError(PeergradeError, ImportError):
    """A user's Python file (reward, tool, environment) that fails to import: a syntax error,
    an exception or a ``sys.exit()`` at import time; one line naming the file, the line and the
    exception."""


class RewardTimeout(Exception):
    """A reward function's call that had not returned within its limit (``RewardSpec.timeout_s``:
    ``rewards[i].timeout_s`` or ``train.reward_timeout_s``); the call is abandoned (its thread
    is left to finish on its own) and goes through ``on_error`` like an exception."""

    def __init__(self, name: str, limit: float, n: int):
        super().__init__(
            f"reward {name!r} did not return within {limit:g} s on a batch of {n} completions "
            "(rewards[i].timeout_s / train.reward_timeout_s)"
        )
        self.limit = limit


def available_rewards() -> list[str]:
    """The names of the built-in rewards."""
    return sorted(BUILTIN_REWARDS)


def _import_attr(module_name: str, attr: str, *, what: str):
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ValueError(
                f"{what}: module {module_name!r} cannot be imported ({exc}). Give a built-in "
                f"name ({', '.join(available_rewards())}), an importable 'module:function', "
                "or 'path/to/file.py:function'"
            ) from exc
        raise ImportError(f"{what}: importing {module_name!r} failed: {exc}") from exc
    return _get_callable(module, attr, what=what, where=f"module {module_name!r}")


def _get_callable(module, attr: str, *, what: str, where: str):
    if not hasattr(module, attr):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        hint = difflib.get_close_matches(attr, found, n=1)
        raise ValueError(
            f"{what}: {where} has no attribute {attr!r}"
            + (f" (did you mean {hint[0]!r}?)" if hint else "")
            + (f"; callables defined there: {', '.join(found)}" if found else "")
        )
    fn = getattr(module, attr)
    if not callable(fn):
        raise ValueError(
            f"{what}: {where} attribute {attr!r} is a {type(fn).__name__}, not a callable"
        )
    return fn


def _load_file(path_str: str, attr: str, *, what: str):
    path = Path(path_str).expanduser()
    if not path.is_file():
        raise ValueError(f"{what}: file {str(path)!r} does not exist (resolved {path.resolve()})")
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    mod_name = f"peergrade_user_reward_{resolved.stem}_{digest}"
    if mod_name in sys.modules:
        module = sys.modules[mod_name]
    else:
        spec = importlib.util.spec_from_file_location(mod_name, resolved)
        if spec is None or spec.loader is None:
            raise ValueError(f"{what}: {str(path)!r} cannot be loaded as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        # its own folder is importable, as for `python file.py`: a file importing a sibling
        # module (`from helpers import ...`) loads wherever peergrade runs from (appended, so
        # a sibling never shadows an installed package)
        if str(resolved.parent) not in sys.path:
            sys.path.append(str(resolved.parent))
        try:
            spec.loader.exec_module(module)
        except ModuleNotFoundError as exc:
            del sys.modules[mod_name]
            if exc.name is None:
                raise
            top = exc.name.split(".")[0]
            if (resolved.parent / f"{top}.py").is_file() or (resolved.parent / top).is_dir():
                raise MissingPackageError(
                    f"{what}: {str(path)!r} imports {exc.name!r}; {top!r} next to it in "
                    f"{str(resolved.parent)!r} could not be imported as {exc.name!r} (an "
                    "installed package of that name comes first, or a submodule is missing): "
                    "rename the sibling module, or import it relative to a package"
                ) from None
            # the user's file imports a package this environment lacks: the pip line, no traceback
            raise MissingPackageError(
                f"{what}: {str(path)!r} imports {exc.name!r}, which is not installed: "
                f"pip install {exc.name.split('.')[0]} (or the package that provides it)"
            ) from None
        except BaseException as exc:
            del sys.modules[mod_name]
            if not isinstance(exc, Exception) and not users_own_stop(exc):
                raise  # a real Ctrl-C while importing
            raise UserFileError(
                f"{what}: executing {str(path)!r} failed{_line_in(exc, resolved)}: "
                + (
                    describe_exit(exc)
                    if not isinstance(exc, Exception)
                    else f"{type(exc).__name__}: {exc}"
                )
            ) from None
    return _get_callable(module, attr, what=what, where=f"file {str(path)!r}")


def _line_in(exc: BaseException, path: Path) -> str:
    """`` at line N``: the last line of ``path`` in ``exc``'s traceback (a SyntaxError's own
    line), or nothing."""
    if isinstance(exc, SyntaxError) and exc.lineno:
        return f" at line {exc.lineno}"
    lines = [
        f.lineno
        for f in traceback.extract_tb(exc.__traceback__)
        if Path(f.filename).resolve() == path
    ]
    return f" at line {lines[-1]}" if lines else ""


def resolve_reward(spec: str | Callable) -> Callable:
    """The reward function named by ``spec`` (built-in name, ``module:fn`` or ``file.py:fn``).

    A callable is returned unchanged. Errors name what was looked for and what exists.
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(
            f"a reward must be a built-in name, 'module:function' or 'path/to/file.py:function', "
            f"got {spec!r}"
        )
    spec = spec.strip()
    what = f"reward {spec!r}"
    if spec in BUILTIN_REWARDS:
        module_name, attr = BUILTIN_REWARDS[spec].split(":")
        try:
            module = importlib.import_module(module_name)
        except MissingPackageError:
            raise
        except ImportError as exc:
            raise ImportError(
                f"built-in reward {spec!r} is not available: importing {module_name!r} "
                f"failed ({type(exc).__name__}: {exc})"
            ) from exc
        return _get_callable(module, attr, what=what, where=f"module {module_name!r}")
    if ":" in spec:
        target, attr = spec.rsplit(":", 1)
        if not target or not attr:
            raise ValueError(f"{what}: expected 'module:function' or 'path/to/file.py:function'")
        if target.endswith(".py") or "/" in target or "\\" in target:
            return _load_file(target, attr, what=what)
        return _import_attr(target, attr, what=what)
    close = difflib.get_close_matches(spec, available_rewards(), n=1, cutoff=0.5)
    raise ValueError(
        f"unknown reward {spec!r}"
        + (f" (did you mean {close[0]!r}?)" if close else "")
        + f". Built-in rewards: {', '.join(available_rewards())}. A custom function is given as "
        "'module:function' or 'path/to/file.py:function'"
    )


@dataclass
class RewardSpec:
    """One reward function in the mix: its metric ``name``, callable, weight and bound kwargs."""

    name: str
    fn: Callable
    weight: float = 1.0
    kwargs: dict = field(default_factory=dict)
    # user code only (the trainer sets it): each batch call runs in a thread of its own, given
    # this many seconds (inf: no limit), so a hang or a sys.exit() in it is its own failure
    timeout_s: float | None = None

    def __post_init__(self):
        if not callable(self.fn):
            raise ValueError(f"reward {self.name!r}: fn is not callable ({self.fn!r})")
        w = float(self.weight)
        if not math.isfinite(w):
            raise ValueError(f"reward {self.name!r}: weight must be finite, got {self.weight!r}")
        self.weight = w
        self.kwargs = dict(self.kwargs or {})
        reserved = sorted(k for k in self.kwargs if k in CONTRACT_KWARGS)
        if reserved:
            raise ValueError(
                f"reward {self.name!r}: kwargs {reserved} are reserved (the trainer passes "
                f"{', '.join(CONTRACT_KWARGS)} itself)"
            )
        check_reward_options(self.name, self.fn, self.kwargs)

    @property
    def bound(self) -> Callable:
        """``fn`` with the configured keyword arguments bound (``functools.partial``)."""
        return functools.partial(self.fn, **self.kwargs) if self.kwargs else self.fn

    @property
    def is_async(self) -> bool:
        """Whether calling ``fn`` gives a coroutine (``async def``, also as a ``__call__``)."""
        fn = self.fn
        while isinstance(fn, functools.partial):
            fn = fn.func
        return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004 - an instance with async __call__
        )


def reward_options(fn: Callable) -> set[str] | None:
    """The option names ``fn`` takes as keyword arguments, or None when they cannot be known:
    a signature that cannot be read, or a user's function whose ``**kwargs`` may read options.

    peergrade's built-ins take the dataset's columns as ``**_columns`` and their options as
    named parameters, so a name outside those is a typo there, not a column."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins and C functions: nothing to check against
        return None
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    named = {p.name for p in params if p.kind in kinds} - set(CONTRACT_KWARGS)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        module = getattr(fn, "__module__", None) or ""
        if not module.startswith("peergrade."):
            return None
    return named


def check_reward_options(name: str, fn: Callable, options: dict) -> None:
    """``ValueError`` naming each option ``fn`` does not take, the closest valid name and the
    valid ones: for training (``rewards[i].kwargs``) and ``peergrade eval --reward-option``
    alike, before any model loads."""
    named = reward_options(fn)
    unknown = [] if named is None else sorted(set(options) - named)
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(named), n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ValueError(
        f"reward {name!r} has no option {', '.join(hints)}; "
        f"its options: {', '.join(sorted(named)) or 'none'}"
    )


def callable_name(fn: Callable) -> str:
    """A function's display name: its ``__name__`` (a partial unwrapped), else its class name."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def check_display_name(name, where: str = "display_name") -> str:
    """``name`` if it is a valid reward display name, else ``ValueError`` saying what is valid."""
    if not isinstance(name, str) or not _DISPLAY_NAME_RE.fullmatch(name) or name == "total":
        raise ValueError(
            f"{where} {name!r} is not valid: use 1-64 letters, digits, '_', '-' or '.' "
            "(no '/', which separates metric names; not 'total', which is the weighted sum), "
            "e.g. display_name: accuracy_gsm8k"
        )
    return name


def make_reward_spec(
    spec: str | Callable, weight: float = 1.0, kwargs: dict | None = None, name: str | None = None
) -> RewardSpec:
    """Resolve ``spec`` and wrap it: the name defaults to the built-in name or function name."""
    fn = resolve_reward(spec)
    # A function that must check its environment before the first step (the code reward's
    # sandbox self-test) does so now, with its configured keyword arguments.
    preflight = getattr(fn, "preflight", None)
    if callable(preflight):
        preflight(**(kwargs or {}))
    if name is None:
        if isinstance(spec, str) and spec.strip() in BUILTIN_REWARDS:
            name = spec.strip()
        else:
            name = callable_name(fn)
    return RewardSpec(name=name, fn=fn, weight=weight, kwargs=kwargs or {})


def make_reward_specs(items: Sequence[tuple]) -> list[RewardSpec]:
    """Specs with unique names from ``(spec, weight, kwargs, display_name)`` tuples (errors
    name the item as ``rewards[i]``, its place in the config's list).

    A given ``display_name`` is checked (``check_display_name``) and must be unique; the others
    get their default name (``make_reward_spec``), made unique by appending ``_2``, ``_3``, ...
    (in order; a given display name is never taken)."""
    specs, given = [], []
    for i, item in enumerate(items):
        spec, weight, kwargs, display = (tuple(item) + (None,) * 4)[:4]
        if display is not None:
            check_display_name(display, where=f"rewards[{i}].display_name")
        specs.append(make_reward_spec(spec, 1.0 if weight is None else weight, kwargs, display))
        given.append(display is not None)
    taken: set[str] = set()
    for i, (s, g) in enumerate(zip(specs, given)):
        if g:
            if s.name in taken:
                raise ValueError(
                    f"rewards[{i}].display_name {s.name!r} is used by two rewards; each needs "
                    "its own (it names reward/<display_name>/... in the metrics)"
                )
            taken.add(s.name)
    for s, g in zip(specs, given):
        if not g:
            base, k = s.name, 2
            while s.name in taken or s.name == "total":
                s.name, k = f"{base}_{k}", k + 1
            taken.add(s.name)
    return specs


def required_columns(spec: RewardSpec) -> list[str]:
    """The dataset columns ``spec`` cannot score without, so that a dataset lacking one is
    refused before the model loads: its parameters without a default that the trainer does not
    pass itself (``CONTRACT_KWARGS``) and that are not bound in ``spec.kwargs``, plus the
    function's own ``required_columns`` attribute (the built-ins take ``answer=None`` so that
    they can say what is missing when called directly). A TRL-style ``**kwargs`` requires
    nothing."""
    fn = spec.fn
    bound = set(spec.kwargs)
    while isinstance(fn, functools.partial):
        bound |= set(fn.keywords)
        fn = fn.func
    names = list(getattr(fn, "required_columns", ()))
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins and C functions: nothing to read
        params = ()
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty:
            continue
        if p.kind is p.POSITIONAL_ONLY:  # cannot be passed by keyword: not a column
            continue
        names.append(p.name)
    out: list[str] = []
    for n in names:
        if n not in CONTRACT_KWARGS and n not in bound and n not in out:
            out.append(n)
    return out


@dataclass(frozen=True)
class TrainerState:
    """What a reward function reads from ``trainer_state``: the parts of
    ``transformers.TrainerState`` that describe training progress, with the same names.

    A step is one peergrade training step (one batch of prompts x group completions); while a
    batch is scored, ``global_step`` counts the steps completed before it (0 in the first step,
    as in TRL, where the trainer's state is read before the step's optimizer update)."""

    global_step: int = 0
    max_steps: int = 0
    #: passes over the training rows completed; a task without a length (a generator) counts
    #: the whole run as one epoch, as transformers does for a dataset without a length
    epoch: float = 0.0
    num_train_epochs: int = 0
    #: completions per step (prompts_per_step x group_size)
    train_batch_size: int | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True

    def __getattr__(self, name: str):
        # only reached for a missing attribute: say what exists instead of a bare AttributeError
        fields = ", ".join(f.name for f in dataclasses.fields(TrainerState))
        raise AttributeError(
            f"trainer_state has no attribute {name!r}; peergrade's trainer_state has {fields} "
            "(the parts of transformers.TrainerState that describe training progress)"
        )

    @classmethod
    def at_step(
        cls, step: int, max_steps: int, batch_size: int, prompts_per_step: int, num_rows=None
    ) -> TrainerState:
        """The state while step ``step`` (1-based) is scored, ``num_rows`` training rows (or
        ``None`` for an endless task) consumed ``prompts_per_step`` at a time."""
        done = max(0, step - 1)
        if num_rows:
            epoch = done * prompts_per_step / num_rows
            epochs = math.ceil(max_steps * prompts_per_step / num_rows)
        else:
            epoch = done / max_steps if max_steps else 0.0
            epochs = 1
        return cls(
            global_step=done,
            max_steps=max_steps,
            epoch=float(epoch),
            num_train_epochs=epochs,
            train_batch_size=batch_size,
        )


@dataclass
class RewardScores:
    """Scores of one batch: per function (NaN = not scored), weighted total, and failures;
    plus what the functions logged (``log_extra`` columns, ``log_metric`` means)."""

    per_fn: dict[str, torch.Tensor]  # name -> [N] float32, NaN where None or not scored
    total: torch.Tensor  # [N] float32, NaN where no function scored the sample
    num_errors: int = 0  # affected samples, summed over functions
    errors: list[str] = field(default_factory=list)
    extra: dict[str, list] = field(default_factory=dict)  # log_extra: column -> N values
    logged: dict[str, float] = field(default_factory=dict)  # log_metric: name -> batch mean
    counts: dict[str, float] = field(default_factory=dict)  # e.g. reward/<fn>/sandbox_errors
    weights: dict[str, float] = field(default_factory=dict)  # name -> weight (GDPO reads them)

    def metrics(self) -> dict[str, float]:
        """``reward/<name>/mean|std``, ``reward/total/mean|std``, ``reward/errors``, the
        per-function failure counts (``reward/<fn>/sandbox_errors``) and the ``log_metric``
        values under their own names. Over scored samples only; std with ddof 1 (TRL's
        ``nanstd``), left out below two scored samples."""
        import torch

        out: dict[str, float] = {}
        for name, values in list(self.per_fn.items()) + [("total", self.total)]:
            v = values[~torch.isnan(values)].double()
            if v.numel():
                out[f"reward/{name}/mean"] = v.mean().item()
            if v.numel() > 1:
                out[f"reward/{name}/std"] = v.std(correction=1).item()
        out["reward/errors"] = float(self.num_errors)
        out.update(self.counts)
        out.update(self.logged)
        return out

    def sample_fields(self, rows: slice) -> dict:
        """The per-completion record of ``rows`` for ``samples.jsonl``: each function's scores
        (``None`` = not scored) and the ``log_extra`` columns."""
        out: dict = {
            "rewards_by_fn": {
                name: [None if math.isnan(x) else x for x in v[rows].tolist()]
                for name, v in self.per_fn.items()
            }
        }
        if self.extra:
            out["extra"] = {col: values[rows] for col, values in self.extra.items()}
        return out


def _format_exc(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"


def is_conversational(prompt) -> bool:
    """TRL's test: a prompt is conversational when it is a list of messages (dicts with a role)."""
    return (
        isinstance(prompt, (list, tuple))
        and len(prompt) > 0
        and all(isinstance(m, dict) and "role" in m for m in prompt)
    )


def as_trl_completions(prompts: Sequence, completions: Sequence) -> list:
    """Completions in the form TRL gives reward functions: ``[{"role": "assistant", "content":
    text}]`` where the row's prompt is conversational, the text otherwise (an item that is not
    a string already is kept as it is)."""
    return [
        [{"role": "assistant", "content": c}] if isinstance(c, str) and is_conversational(p) else c
        for p, c in zip(prompts, completions)
    ]


# ----------------------------------------------------------------------------- async functions

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    """The process's reward event loop, started on first use in a daemon thread.

    One loop for the whole run (as TRL's ``async_loop``), so that clients an async reward keeps
    between calls (HTTP sessions bound to a loop) stay valid, and so that scoring works when
    the caller is itself inside a running loop (a notebook), where ``asyncio.run`` refuses."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="peergrade-rewards", daemon=True).start()
            _loop = loop
    return _loop


def _forget_loop() -> None:
    """In a forked child (the pipelined rollouts' producer process): the loop's thread stayed
    in the parent, so the child starts its own on first use."""
    global _loop, _loop_lock
    _loop, _loop_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_loop)


def _run_awaitables(awaitables: list) -> list:
    """Results of ``awaitables`` awaited concurrently; an exception is returned, not raised."""

    async def gather():
        return await asyncio.gather(*awaitables, return_exceptions=True)

    return asyncio.run_coroutine_threadsafe(gather(), _event_loop()).result()


def _call_now(call: Callable, kwargs: dict):
    """``call(**kwargs)``, an awaitable result awaited (on the reward loop); raises."""
    out = call(**kwargs)
    if inspect.isawaitable(out):
        (out,) = _run_awaitables([out])
        if isinstance(out, BaseException):
            raise out
    return out


def _call_guarded(spec: RewardSpec, call: Callable, kwargs: dict, n: int):
    """``call(**kwargs)``'s result, or what stopped it as a value: an exception, ``SystemExit``
    or ``KeyboardInterrupt`` raised by the function (a failure of that function, never the end
    of the run), or a ``RewardTimeout``. With ``spec.timeout_s`` (user code) the call runs under
    ``limits.call_within``: from the main thread the function runs there, as TRL runs it
    (libraries that set signal handlers, e.g. math-verify's parse timeout, need the main
    thread), and a watchdog interrupts it past its limit; from another thread it runs in a
    thread of its own. The trainer's own stop (``errors.Stop``, a second Ctrl-C) goes through.
    Built-in rewards run here, unguarded."""
    if spec.timeout_s is None:
        try:
            return _call_now(call, kwargs)
        except Exception as exc:
            return exc
    from peergrade.errors import Stop

    try:
        return call_within(lambda: _call_now(call, kwargs), spec.timeout_s, name=spec.name)
    except TimeLimitExceeded:
        return RewardTimeout(spec.name, spec.timeout_s, n)
    except Stop:
        raise
    except BaseException as exc:  # SystemExit, KeyboardInterrupt: the function's failure
        return exc


async def _await_guarded(spec: RewardSpec, awaitable, n: int):
    """An async function's result or what stopped it (``_call_guarded``'s rules)."""
    limit = spec.timeout_s
    try:
        if limit is None or math.isinf(limit):
            return await awaitable
        return await asyncio.wait_for(awaitable, limit)
    except asyncio.TimeoutError:
        return RewardTimeout(spec.name, limit, n)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # SystemExit, KeyboardInterrupt: the function's failure
        return exc


def _stopped_how(exc: BaseException) -> str:
    """What a SystemExit / KeyboardInterrupt raised by a reward function was."""
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r}) (SystemExit)"
    return "raised KeyboardInterrupt"


# ----------------------------------------------------------------------------- logging


class _Log:
    """The ``log_extra`` / ``log_metric`` of one function's call; kept only if the call succeeds."""

    def __init__(self, fn_name: str, n: int, claimed: dict[str, str]):
        self.fn_name, self.n, self.claimed = fn_name, n, claimed
        self.extra: dict[str, list] = {}
        self.metrics: dict[str, list[float]] = {}

    def log_extra(self, column: str, values) -> None:
        if not isinstance(column, str) or not column:
            raise ValueError(f"log_extra: column must be a non-empty string, got {column!r}")
        owner = self.claimed.get(column)
        if owner is not None:
            raise ValueError(
                f"log_extra: column {column!r} was already logged for this batch"
                + (f" by reward {owner!r}" if owner != self.fn_name else "")
            )
        if not isinstance(values, (list, tuple)) or len(values) != self.n:
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else repr(values)
            raise ValueError(
                f"log_extra({column!r}, ...): expected a list of {self.n} values (one per "
                f"completion), got {got}"
            )
        values = list(values)
        try:
            json.dumps(values)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"log_extra({column!r}, ...): values must be JSON-serialisable (they are "
                f"written to samples.jsonl): {exc}"
            ) from None
        self.claimed[column] = self.fn_name
        self.extra[column] = values

    def log_metric(self, name: str, value) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"log_metric: name must be a non-empty string, got {name!r}")
        if name in ("step", "final") or name.startswith(RESERVED_METRIC_PREFIXES):
            raise ValueError(
                f"log_metric: name {name!r} is reserved for the trainer's own metrics "
                f"(step, final, {', '.join(p + '...' for p in RESERVED_METRIC_PREFIXES)})"
            )
        try:
            if isinstance(value, (str, bytes)):
                raise TypeError
            v = float(value)
        except (TypeError, ValueError):
            raise TypeError(
                f"log_metric({name!r}, ...): value must be a real number, got "
                f"{type(value).__name__} {value!r:.40}"
            ) from None
        if not math.isfinite(v):
            raise ValueError(f"log_metric({name!r}, ...): value must be finite, got {v}")
        self.metrics.setdefault(name, []).append(v)

    def drop(self) -> None:
        for column in self.extra:
            self.claimed.pop(column, None)
        self.extra.clear()
        self.metrics.clear()


def _no_log(*args, **kwargs) -> None:
    """``log_extra`` / ``log_metric`` while a failed function is re-run to find the culprit."""


# ----------------------------------------------------------------------------- scoring


def columns_for(rows: list[dict], repeat: int) -> dict[str, list]:
    """Dataset columns for the reward functions, each repeated so it aligns with the
    completions: every column but ``prompt``, ``completion`` and ``completion_ids`` (TRL's
    rule: the trainer passes its own completions and ids)."""
    keys = [k for k in rows[0] if k not in ("prompt", "completion", "completion_ids")]
    return {k: [r.get(k) for r in rows for _ in range(repeat)] for k in keys}


def score_rewards(
    specs: Sequence[RewardSpec],
    prompts: Sequence,
    completions: Sequence,
    columns: dict | None = None,
    *,
    on_error: str = "fail",
    trainer_state: TrainerState | None = None,
) -> RewardScores:
    """Call every reward function on the batch and combine the scores (see module docstring).

    ``completions`` are texts (or already TRL-form items); they reach the functions in TRL's
    form for each row (``as_trl_completions``). ``columns`` holds the dataset columns and
    ``completion_ids``. ``trainer_state`` defaults to ``TrainerState()`` (step 0 of 0: scoring
    outside a training run)."""
    import torch

    columns = _checked_batch(specs, prompts, completions, columns, on_error)
    n = len(completions)
    prompts = list(prompts)
    completions = as_trl_completions(prompts, completions)
    state = trainer_state if trainer_state is not None else TrainerState()

    claimed: dict[str, str] = {}
    logs = [_Log(spec.name, n, claimed) for spec in specs]
    calls = _reward_calls(specs, logs, prompts, completions, columns, state)
    outcomes = _call_all(specs, calls, n)

    per_fn: dict[str, torch.Tensor] = {}
    errors: list[str] = []
    num_errors = 0
    counts: dict[str, float] = {}
    extra: dict[str, list] = {}
    logged: dict[str, list[float]] = {}
    for spec, (call, kwargs), log, out in zip(specs, calls, logs, outcomes):
        values, problems, bad = _outcome_scores(spec, call, kwargs, out, n, prompts, state, counts)
        if problems:
            if on_error == "fail":
                shown = problems[:10]
                more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
                raise RewardError(_failed(shown, more))
            errors.extend(problems)
            for i in range(n):
                if bad[i]:
                    values[i] = 0.0
            num_errors += sum(bad)
            if all(bad):  # the call itself failed: what it logged is not trusted
                log.drop()
        extra.update(log.extra)
        for name, vs in log.metrics.items():
            logged.setdefault(name, []).extend(vs)
        per_fn[spec.name] = torch.tensor(values, dtype=torch.float32)  # [N]

    total, problems = _weighted_total(specs, per_fn, n, on_error)
    errors.extend(problems)
    num_errors += len(problems)
    return RewardScores(
        per_fn=per_fn,
        total=total.float(),
        num_errors=num_errors,
        errors=errors,
        extra=extra,
        logged={k: sum(v) / len(v) for k, v in logged.items()},  # TRL: the mean of the calls
        counts=counts,
        weights={spec.name: spec.weight for spec in specs},
    )


def _checked_batch(
    specs: Sequence[RewardSpec],
    prompts: Sequence,
    completions: Sequence,
    columns: dict | None,
    on_error: str,
) -> dict:
    """``score_rewards``' arguments checked (``on_error``; one prompt and one entry of every
    column per completion, no reserved column name; unique reward names): the columns, a dict."""
    if on_error not in ("fail", "zero"):
        raise ValueError(f"on_error={on_error!r} is not valid; expected 'fail' or 'zero'")
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"score_rewards: {len(prompts)} prompts but {n} completions")
    columns = dict(columns or {})
    for key, col in columns.items():
        if key in CONTRACT_KWARGS and key != "completion_ids":
            raise ValueError(f"score_rewards: column name {key!r} is reserved")
        if len(col) != n:
            raise ValueError(f"score_rewards: column {key!r} has {len(col)} entries, expected {n}")
    names = [s.name for s in specs]
    dupes = sorted({x for x in names if names.count(x) > 1})
    if dupes:
        raise ValueError(f"score_rewards: reward names must be unique, repeated: {dupes}")
    return columns


def _reward_calls(
    specs: Sequence[RewardSpec],
    logs: list[_Log],
    prompts: list,
    completions: list,
    columns: dict,
    state: TrainerState,
) -> list[tuple[Callable, dict]]:
    """Each function's call: its bound callable and the contract's keyword arguments."""
    calls = []
    for spec, log in zip(specs, logs):
        cols = {k: v for k, v in columns.items() if k not in spec.kwargs}
        kwargs = {
            "prompts": prompts,
            "completions": completions,
            **cols,
            "trainer_state": state,
            "log_extra": log.log_extra,
            "log_metric": log.log_metric,
        }
        calls.append((spec.bound, kwargs))
    return calls


def _call_all(specs: Sequence[RewardSpec], calls: list[tuple[Callable, dict]], n: int) -> list:
    """Each call's result, or what stopped it as a value (``_call_guarded``,
    ``_await_guarded``): the synchronous functions in order, then the async ones concurrently
    (TRL's order)."""
    outcomes: list = [None] * len(specs)
    pending: list[int] = []
    for j, (spec, (call, kwargs)) in enumerate(zip(specs, calls)):
        if spec.is_async:
            pending.append(j)
            continue
        outcomes[j] = _call_guarded(spec, call, kwargs, n)
    if pending:
        coros = []
        for j in pending:
            call, kwargs = calls[j]
            try:
                coros.append(_await_guarded(specs[j], call(**kwargs), n))
            except Exception as exc:  # raised before its first await (e.g. a bad signature)
                coros.append(_raise_later(exc))
        for j, out in zip(pending, _run_awaitables(coros)):
            outcomes[j] = out
    return outcomes


def _outcome_scores(
    spec: RewardSpec,
    call: Callable,
    kwargs: dict,
    out,
    n: int,
    prompts: list,
    state: TrainerState,
    counts: dict[str, float],
) -> tuple[list[float], list[str], list[bool]]:
    """One function's outcome ``out`` checked: its scores (NaN: not scored), the problems
    found, and the samples to zero under ``on_error="zero"``; its failures counted in
    ``counts`` (``reward/<fn>/<kind>``)."""
    # A function that declares the failures it counts always reports them (0 included).
    for kind in getattr(spec.fn, "error_metrics", ()):
        counts[f"reward/{spec.name}/{kind}"] = 0.0
    problems: list[str] = []
    bad = [False] * n  # samples to zero under on_error="zero"
    values = [math.nan] * n
    failed: dict[int, str] = {}
    if isinstance(out, RewardSampleErrors):
        # Some samples failed (e.g. a program the sandbox could not run): keep the others.
        key = f"reward/{spec.name}/{out.kind}"
        counts[key] = counts.get(key, 0.0) + len(out.failed)
        if len(out.scores) != n:
            problems.append(f"reward {spec.name!r} on the batch of {n}: {out}")
            return values, problems, [True] * n
        failed = out.failed
        for i, why in sorted(failed.items()):
            problems.append(f"reward {spec.name!r} sample {i}: {why}")
            bad[i] = True
        out = out.scores
    whole = _call_failure(spec, call, kwargs, out, n, prompts, state, counts)
    if whole is not None:
        problems.append(whole)
        return values, problems, [True] * n
    _read_scores(spec, out, failed, values, problems, bad)
    return values, problems, bad


def _call_failure(
    spec: RewardSpec,
    call: Callable,
    kwargs: dict,
    out,
    n: int,
    prompts: list,
    state: TrainerState,
    counts: dict[str, float],
) -> str | None:
    """The problem when the call failed as a whole (it timed out, stopped, raised, or returned
    something other than one score per completion); ``None`` when ``out`` is a list of ``n``.
    An exception with ``stops_run`` is raised again."""
    if isinstance(out, RewardTimeout):  # no search for the culprit: n more hangs
        key = f"reward/{spec.name}/timeouts"
        counts[key] = counts.get(key, 0.0) + 1
        first = prompts[0] if prompts else ""
        first = first[-1].get("content", "") if is_conversational(first) else first
        return f"{out}{_at_step(state)}; the batch's first prompt: {str(first)[:60]!r}"
    if isinstance(out, BaseException) and not isinstance(out, Exception):
        # sys.exit() or KeyboardInterrupt inside the function (here only from a function
        # run in its own thread, or awaited): its failure, named
        return f"reward {spec.name!r} {_stopped_how(out)}{_at_step(state)}"
    if isinstance(out, BaseException):
        if getattr(out, "stops_run", False):
            raise out  # e.g. no sandbox for the code reward: no policy may score that as 0
        culprit = _locate_failure(spec, call, kwargs, n)
        return (
            f"reward {spec.name!r} raised on the batch of {n}"
            + (f" (first failing sample index {culprit[0]}: {culprit[1]})" if culprit else "")
            + f": {_format_exc(out)}"
        )
    if not isinstance(out, (list, tuple)):
        return (
            f"reward {spec.name!r} returned a {type(out).__name__}, expected a list of "
            f"{n} floats or None"
        )
    if len(out) != n:
        return (
            f"reward {spec.name!r} returned {len(out)} scores for {n} completions "
            "(a wrong length is never broadcast)"
        )
    return None


def _read_scores(
    spec: RewardSpec,
    out: list | tuple,
    failed: dict[int, str],
    values: list[float],
    problems: list[str],
    bad: list[bool],
) -> None:
    """The scores in ``out`` (one per completion) into ``values``, but for ``None`` and the
    ``failed`` samples; a value that is not a real number finite in float32 goes to
    ``problems`` and its sample to ``bad``."""
    for i, v in enumerate(out):
        if v is None or i in failed:
            continue
        try:
            if isinstance(v, (str, bytes)):
                raise TypeError
            f = float(v)
        except (TypeError, ValueError):
            problems.append(
                f"reward {spec.name!r} sample {i}: {v!r} ({type(v).__name__}) is "
                "not a number or None"
            )
            bad[i] = True
            continue
        if not math.isfinite(f):
            problems.append(f"reward {spec.name!r} sample {i}: non-finite score {f}")
            bad[i] = True
            continue
        if abs(f) > FLOAT32_MAX:  # finite in float64, inf once stored as float32
            problems.append(
                f"reward {spec.name!r} sample {i}: score {f!r} is outside the "
                f"float32 range (|score| <= {FLOAT32_MAX:.4g})"
            )
            bad[i] = True
            continue
        values[i] = f


def _weighted_total(
    specs: Sequence[RewardSpec], per_fn: dict[str, torch.Tensor], n: int, on_error: str
) -> tuple[torch.Tensor, list[str]]:
    """The weighted total per sample (NaN where no function scored it), float64, and the
    problems: a total outside float32 (zeroed here; under ``on_error="fail"``, raised)."""
    import torch

    total = torch.full((n,), math.nan, dtype=torch.float64)  # [N]
    for spec in specs:
        if spec.weight == 0:  # logged only: never turns an abstention into a score of 0
            continue
        r = per_fn[spec.name].double()  # [N]
        scored = ~torch.isnan(r)
        total = torch.where(scored, torch.nan_to_num(total, nan=0.0) + spec.weight * r, total)
    # Scores within float32 can still sum (with weights) past it: same policy, sample named.
    over = (total.abs() > FLOAT32_MAX).nonzero().flatten().tolist()
    problems = [
        f"weighted reward total of sample {i}: {total[i].item():.4g} is outside the float32 "
        f"range (|total| <= {FLOAT32_MAX:.4g}; check the reward weights and scales)"
        for i in over
    ]
    if problems:
        if on_error == "fail":
            raise RewardError(_failed(problems[:10]))
        total[over] = 0.0
    return total, problems


def _failed(problems: list[str], more: str = "") -> str:
    """The ``on_reward_error=fail`` message: one line for one problem, else one per problem."""
    if len(problems) == 1 and not more:
        return f"reward function failed (on_reward_error=fail): {problems[0]}"
    return "reward function failed (on_reward_error=fail):\n  " + "\n  ".join(problems) + more


async def _raise_later(exc: Exception):
    raise exc


def _locate_failure(spec: RewardSpec, call, kwargs: dict, n: int) -> tuple[int, str] | None:
    """Re-run ``call`` one sample at a time (guarded as the batch call was); the first sample
    that raises, else ``None`` (also when a one-sample call runs past the limit)."""
    shared = ("trainer_state", "log_extra", "log_metric")
    per_sample = [k for k in kwargs if k not in shared]
    for i in range(n):
        one = {k: [kwargs[k][i]] for k in per_sample}
        one.update(trainer_state=kwargs["trainer_state"], log_extra=_no_log, log_metric=_no_log)
        out = _call_guarded(spec, call, one, 1)
        if isinstance(out, RewardTimeout):
            return None
        if isinstance(out, BaseException):
            return i, _format_exc(out) if isinstance(out, Exception) else _stopped_how(out)
    return None


def _at_step(state) -> str:
    """Where in the run a batch was scored: `` in step S`` while training, else nothing."""
    if not getattr(state, "max_steps", 0):
        return ""
    return f" in step {state.global_step + 1}"


def reward_state(task, step: int, max_steps: int, prompts: int, group: int) -> TrainerState:
    """The ``trainer_state`` reward functions get while step ``step`` (1-based) is scored."""
    num_rows = len(task) if hasattr(task, "__len__") else None
    return TrainerState.at_step(step, max_steps, prompts * group, prompts, num_rows)
