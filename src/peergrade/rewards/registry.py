"""The reward-function contract, name resolution, and safe scoring of a batch.

Contract (TRL-compatible, so users bring their reward functions unchanged)::

    fn(prompts: list, completions: list, **columns) -> list[float | None]

``prompts`` and ``completions`` are aligned lists of length N (a completion is a string or a
TRL conversational message list ``[{"role": "assistant", "content": ...}]``). ``columns`` are
the dataset's other columns (``answer``, ``tests``, ...) as lists of length N, plus
``completion_ids`` (the token ids of each completion). The function returns one score per
completion; ``None`` means "not applicable to this sample" (excluded from that function's
mean and from the weighted total). Every argument is passed by keyword.

Resolution (``resolve_reward``): a built-in name (``BUILTIN_REWARDS``), ``module:function``
(an importable module), or ``path/to/file.py:function`` (a file, loaded under a private module
name). Built-ins are imported lazily: resolving one name imports only its module.

Scoring (``score_rewards``): each ``RewardSpec`` is called once on the whole batch with its
configured keyword arguments bound by ``functools.partial`` (a configured keyword wins over a
dataset column of the same name). A function that raises, returns something other than a
list/tuple, returns a list of the wrong length (never broadcast), or returns a value that is
not a real number finite in float32 (``|v| <= FLOAT32_MAX``: scores are stored as float32, so
1e300 is as bad as inf), is reported with the function name, the sample index and the
exception; then ``on_error="fail"`` raises ``RewardError`` and ``on_error="zero"`` scores 0
for the affected samples (for an exception or a wrong length: every sample of that call) and
counts them in ``num_errors``. When a batch call raises, the function is called again one
sample at a time, in order, until a sample raises, to name the culprit in the report (this
diagnostic only runs on failure; a function with side effects runs more than once then).

A function that could score some samples but not others raises ``RewardSampleErrors`` with
the scores it has: only the failed samples go through ``on_error``, and they are also counted
under ``reward/<fn>/<kind>`` (the code reward's ``sandbox_errors``; a function listing kinds in
its ``error_metrics`` attribute reports them every step, 0 included). An exception with
``stops_run = True`` (no sandbox for the code reward) is re-raised whatever ``on_error`` says.
A function with a ``preflight`` attribute has it called by ``make_reward_spec`` with the
configured keyword arguments, before the first step (the code reward's sandbox self-test).

The weighted total is ``total[i] = sum_f w_f * r_f[i]`` over the functions that scored sample
``i`` (``r_f[i]`` not ``None``); ``NaN`` where no function did. Metrics: the mean and the
population standard deviation (ddof = 0) over scored samples; a function that scored no sample
has no mean/std key (JSON has no NaN). A weighted total beyond the float32 range (each score
in range, the weights too large) goes through the same policy: ``fail`` raises, ``zero`` sets
that sample's total to 0 and counts it in ``num_errors``.

This module knows nothing about tokenizers, models, or advantages.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib
import importlib.util
import math
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from peergrade.errors import PeergradeError

if TYPE_CHECKING:  # torch is imported when scoring, so importing this package stays light
    import torch

__all__ = [
    "BUILTIN_REWARDS",
    "RewardError",
    "RewardSampleErrors",
    "RewardScores",
    "RewardSpec",
    "available_rewards",
    "make_reward_spec",
    "resolve_reward",
    "score_rewards",
]

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
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[mod_name]
            raise ImportError(
                f"{what}: executing {str(path)!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
    return _get_callable(module, attr, what=what, where=f"file {str(path)!r}")


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

    def __post_init__(self):
        if not callable(self.fn):
            raise ValueError(f"reward {self.name!r}: fn is not callable ({self.fn!r})")
        w = float(self.weight)
        if not math.isfinite(w):
            raise ValueError(f"reward {self.name!r}: weight must be finite, got {self.weight!r}")
        self.weight = w
        self.kwargs = dict(self.kwargs or {})

    @property
    def bound(self) -> Callable:
        """``fn`` with the configured keyword arguments bound (``functools.partial``)."""
        return functools.partial(self.fn, **self.kwargs) if self.kwargs else self.fn


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
            name = getattr(fn, "__name__", None) or type(fn).__name__
    return RewardSpec(name=name, fn=fn, weight=weight, kwargs=kwargs or {})


@dataclass
class RewardScores:
    """Scores of one batch: per function (NaN = not scored), weighted total, and failures."""

    per_fn: dict[str, torch.Tensor]  # name -> [N] float32, NaN where None or not scored
    total: torch.Tensor  # [N] float32, NaN where no function scored the sample
    num_errors: int = 0  # affected samples, summed over functions
    errors: list[str] = field(default_factory=list)
    counts: dict[str, float] = field(default_factory=dict)  # e.g. reward/<fn>/sandbox_errors

    def metrics(self) -> dict[str, float]:
        """``reward/<name>/mean|std``, ``reward/total/mean|std``, ``reward/errors``, and the
        per-function failure counts (``reward/<fn>/sandbox_errors``)."""
        import torch

        out: dict[str, float] = {}
        for name, values in list(self.per_fn.items()) + [("total", self.total)]:
            v = values[~torch.isnan(values)]
            if v.numel():
                out[f"reward/{name}/mean"] = v.double().mean().item()
                out[f"reward/{name}/std"] = v.double().std(correction=0).item()
        out["reward/errors"] = float(self.num_errors)
        out.update(self.counts)
        return out


_RAISED = object()  # score_rewards: the call raised, there is no output to check


def _format_exc(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _slice_columns(columns: dict, i: int) -> dict:
    return {k: [v[i]] for k, v in columns.items()}


def score_rewards(
    specs: Sequence[RewardSpec],
    prompts: Sequence,
    completions: Sequence,
    columns: dict | None = None,
    *,
    on_error: str = "fail",
) -> RewardScores:
    """Call every reward function on the batch and combine the scores (see module docstring)."""
    import torch

    if on_error not in ("fail", "zero"):
        raise ValueError(f"on_error={on_error!r} is not valid; expected 'fail' or 'zero'")
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"score_rewards: {len(prompts)} prompts but {n} completions")
    columns = dict(columns or {})
    for key, col in columns.items():
        if key in ("prompts", "completions"):
            raise ValueError(f"score_rewards: column name {key!r} is reserved")
        if len(col) != n:
            raise ValueError(f"score_rewards: column {key!r} has {len(col)} entries, expected {n}")
    names = [s.name for s in specs]
    dupes = sorted({x for x in names if names.count(x) > 1})
    if dupes:
        raise ValueError(f"score_rewards: reward names must be unique, repeated: {dupes}")
    prompts, completions = list(prompts), list(completions)

    per_fn: dict[str, torch.Tensor] = {}
    errors: list[str] = []
    counts: dict[str, float] = {}
    num_errors = 0
    for spec in specs:
        # A function that declares the failures it counts always reports them (0 included).
        for kind in getattr(spec.fn, "error_metrics", ()):
            counts[f"reward/{spec.name}/{kind}"] = 0.0
        call = spec.bound
        cols = {k: v for k, v in columns.items() if k not in spec.kwargs}
        problems: list[str] = []
        bad = [False] * n  # samples to zero under on_error="zero"
        values = [math.nan] * n
        failed: dict[int, str] = {}
        out = _RAISED
        try:
            out = call(prompts=prompts, completions=completions, **cols)
        except RewardSampleErrors as exc:
            # Some samples failed (e.g. a program the sandbox could not run): keep the others.
            key = f"reward/{spec.name}/{exc.kind}"
            counts[key] = counts.get(key, 0.0) + len(exc.failed)
            if len(exc.scores) == n:
                out, failed = exc.scores, exc.failed
                for i, why in sorted(failed.items()):
                    problems.append(f"reward {spec.name!r} sample {i}: {why}")
                    bad[i] = True
            else:
                problems.append(f"reward {spec.name!r} on the batch of {n}: {exc}")
                bad = [True] * n
        except Exception as exc:
            if getattr(exc, "stops_run", False):
                raise  # e.g. no sandbox for the code reward: no policy may score that as 0
            culprit = _locate_failure(call, prompts, completions, cols)
            problems.append(
                f"reward {spec.name!r} raised on the batch of {n}"
                + (f" (first failing sample index {culprit[0]}: {culprit[1]})" if culprit else "")
                + f": {_format_exc(exc)}"
            )
            bad = [True] * n
        if out is not _RAISED:
            if not isinstance(out, (list, tuple)):
                problems.append(
                    f"reward {spec.name!r} returned a {type(out).__name__}, expected a list of "
                    f"{n} floats or None"
                )
                bad = [True] * n
            elif len(out) != n:
                problems.append(
                    f"reward {spec.name!r} returned {len(out)} scores for {n} completions "
                    "(a wrong length is never broadcast)"
                )
                bad = [True] * n
            else:
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
        if problems:
            if on_error == "fail":
                shown = problems[:10]
                more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
                raise RewardError(
                    "reward function failed (on_reward_error=fail):\n  " + "\n  ".join(shown) + more
                )
            errors.extend(problems)
            for i in range(n):
                if bad[i]:
                    values[i] = 0.0
            num_errors += sum(bad)
        per_fn[spec.name] = torch.tensor(values, dtype=torch.float32)  # [N]

    total = torch.full((n,), math.nan, dtype=torch.float64)  # [N]
    for spec in specs:
        r = per_fn[spec.name].double()  # [N]
        scored = ~torch.isnan(r)
        total = torch.where(scored, torch.nan_to_num(total, nan=0.0) + spec.weight * r, total)
    # Scores within float32 can still sum (with weights) past it: same policy, sample named.
    over = (total.abs() > FLOAT32_MAX).nonzero().flatten().tolist()
    if over:
        problems = [
            f"weighted reward total of sample {i}: {total[i].item():.4g} is outside the float32 "
            f"range (|total| <= {FLOAT32_MAX:.4g}; check the reward weights and scales)"
            for i in over
        ]
        if on_error == "fail":
            raise RewardError(
                "reward function failed (on_reward_error=fail):\n  " + "\n  ".join(problems[:10])
            )
        errors.extend(problems)
        total[over] = 0.0
        num_errors += len(over)
    return RewardScores(
        per_fn=per_fn, total=total.float(), num_errors=num_errors, errors=errors, counts=counts
    )


def _locate_failure(call, prompts, completions, cols) -> tuple[int, str] | None:
    """Re-run ``call`` one sample at a time; the first sample that raises, else ``None``."""
    for i in range(len(completions)):
        try:
            call(prompts=[prompts[i]], completions=[completions[i]], **_slice_columns(cols, i))
        except Exception as exc:
            return i, _format_exc(exc)
    return None
