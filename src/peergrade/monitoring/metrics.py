"""What a user watches: metrics.jsonl, samples.jsonl, logging backends and the live display.

``JsonlWriter`` appends one JSON object per line and flushes it, so a crash loses at most the
line being written. ``MetricLogger`` writes metrics.jsonl (always) and feeds the same lines, under
the same names, to the backends of ``train.report_to``: TensorBoard (event files in
``<run>/tensorboard``), trackio (its local store, ``TRACKIO_DIR``) and W&B (``<run>/wandb``;
``WANDB_MODE=offline`` logs without an account or network). Each backend is imported only when
selected; ``check_backends`` names the missing pip package before anything is loaded.
``Display`` shows the run: a rich live panel in an interactive terminal (step, reward, the
scorer's mean -- ``acc`` while every score is 0 or 1, so a share correct, else ``score`` --, KL,
completion length, tokens/s, ETA; failed reward calls and failed harness episodes when there are
any), plain one-line-per-step output otherwise (CI logs, pipes), or nothing; alerts are printed
when they start and listed while they last.
``quiet_hf_progress`` is the one policy for transformers' own progress bars ("Loading weights",
"Writing model shards"): off while peergrade works, since its display is the progress, whether
the CLI or ``trainer.train`` from Python started it; the caller's setting is restored after.
``Tee`` hands every metrics line to a Python caller's ``on_log`` as well (``peergrade.api``).

What the files hold (what the run report reads):

- metrics.jsonl: one object per step, ``{"step": s, <name>: value, ...}`` with namespaced names
  (``reward/<fn>/mean|std``, ``reward/total/mean``, ``reward/accuracy``, ``loss/policy``,
  ``kl/mean``, ``entropy/mean``, ``rollout/len_mean``, ``rollout/frac_zero_std_groups``,
  ``rollout/repetition``, ``update/nonfinite_frac``, ``perf/tokens_per_s``, ``time/<phase>_s``;
  through a harness ``harness/failed_episodes`` of ``harness/episodes`` and the text
  ``harness/top_error``; ``eval/<metric>`` on evaluation steps, step 0 = before training, ``"final": true`` = after);
  NaN/inf are written as null. Active detectors (``peergrade.monitoring.detectors``) add
  ``alert/<name>: 1.0`` and ``"alerts": {<name>: <message>}`` to the step's line, and
  ``update/skipped_total`` counts optimizer steps skipped for a non-finite loss or gradient.
- samples.jsonl: per logged prompt, ``{"step", "prompt", "answer", "completions": [G],
  "rewards": [G] (weighted total), "rewards_by_fn": {<fn>: [G]} (each function's raw score,
  null where it gave none), "advantages": [G], "finish_reason": [G]}``.

Backends get only the numeric values (``alerts``, texts and flags stay in the JSON). This module
computes no metric and no alert itself.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from peergrade.errors import InputError

# backend -> (module to import, pip package that provides it)
BACKENDS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "trackio": ("trackio", "trackio"),
    "wandb": ("wandb", "wandb"),
}


class JsonlWriter:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, obj: dict[str, Any]) -> None:
        self._f.write(json.dumps(_clean(obj), ensure_ascii=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def quiet_hf_progress():
    """transformers' progress bars off inside (a context manager and a decorator: the CLI's
    commands and ``trainer.train`` use it); a caller's setting is restored after, so the
    ``from_pretrained`` calls of a Python user's own code keep their bars."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def check_backends(report_to: list[str]) -> None:
    """Raise InputError naming the pip package of each selected backend that is not installed
    (without importing any: a run fails here, before the model loads, not after)."""
    missing = []
    for name in report_to:
        if name not in BACKENDS:
            raise InputError(
                f"train.report_to: unknown backend {name!r}; choose from {', '.join(BACKENDS)}"
            )
        module, package = BACKENDS[name]
        if importlib.util.find_spec(module) is None:
            missing.append(package)
    if missing:
        raise InputError(
            f"train.report_to asks for {', '.join(missing)}, which is not installed: "
            f"pip install {' '.join(missing)}  (or pip install 'peergrade[logging]'; "
            "or drop it from train.report_to)"
        )


def _scalars(obj: dict[str, Any]) -> dict[str, float]:
    """The numeric values of a metrics line, minus its step (what the backends plot)."""
    return {
        k: float(v)
        for k, v in obj.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class MetricLogger:
    """metrics.jsonl plus the ``report_to`` backends; ``write`` feeds one metrics line to all.

    ``resume`` continues the run's backend records: TensorBoard drops events after the resumed
    step (``purge_step``), W&B and trackio reopen the same run."""

    def __init__(
        self,
        run_dir: Path,
        report_to: list[str] | None = None,
        *,
        project: str = "peergrade",
        config: dict | None = None,
        resume: bool = False,
        start_step: int = 0,
    ):
        run_dir = Path(run_dir)
        report_to = list(report_to or [])
        check_backends(report_to)
        self.jsonl = JsonlWriter(run_dir / "metrics.jsonl")
        self._tb = self._wandb = self._trackio = None
        name = run_dir.resolve().name
        if "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(
                str(run_dir / "tensorboard"), purge_step=start_step + 1 if resume else None
            )
        if "wandb" in report_to:
            import wandb

            # the run id lives in the run directory, so --resume reopens the same W&B run
            id_file = run_dir / "wandb" / "peergrade-run-id"
            id_file.parent.mkdir(parents=True, exist_ok=True)
            run_id = id_file.read_text().strip() if resume and id_file.exists() else None
            self._wandb = wandb.init(
                project=project,
                name=name,
                dir=str(run_dir),
                config=config,
                id=run_id,
                resume="allow" if run_id else None,
            )
            id_file.write_text(self._wandb.id)
        if "trackio" in report_to:
            import trackio

            self._trackio = trackio.init(
                project=project, name=name, config=config, resume="allow" if resume else "never"
            )

    def write(self, obj: dict[str, Any]) -> None:
        self.jsonl.write(obj)
        values = _scalars(obj)
        step = obj.get("step")
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, v, global_step=step)
            self._tb.flush()  # a killed run keeps what it logged
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        if self._trackio is not None:
            self._trackio.log(values, step=step)

    def close(self) -> None:
        """Close every backend (once; later calls do nothing)."""
        if self.jsonl is None:
            return
        self.jsonl.close()
        self.jsonl = None
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._trackio is not None:
            self._trackio.finish()

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _clean(obj: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def _fmt(v: Any, spec: str = ".3f") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return format(v, spec)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def _error_note(metrics: dict[str, Any]) -> str:
    """``  reward errors N (sandbox M)`` when a reward failed this step (scored 0 under
    on_reward_error: zero), else nothing: a failing reward never looks like a low score."""
    errors = metrics.get("reward/errors") or 0
    sandbox = sum(
        v for k, v in metrics.items() if k.endswith("/sandbox_errors") and isinstance(v, float)
    )
    if not errors and not sandbox:
        return ""
    return f"  reward errors {int(errors)}" + (f" (sandbox {int(sandbox)})" if sandbox else "")


def _harness_note(metrics: dict[str, Any]) -> str:
    """``  failed F/N`` when episodes run through a harness failed this step (each scored 0):
    a failing agent never looks like a low score."""
    failed, total = metrics.get("harness/failed_episodes"), metrics.get("harness/episodes")
    if not failed or not total:
        return ""
    return f"  failed {int(failed)}/{int(total)}"


def _stats_progress(*columns, **kwargs):
    """A rich ``Progress`` whose bar line holds only the name, bar, step counter and ETA, with
    the step's stats on the line below: a narrow terminal (80 columns, or fewer) then folds the
    stats instead of cutting the counter and the ETA (all on one line, it cut them first)."""
    from rich.progress import Progress
    from rich.text import Text

    class StatsProgress(Progress):
        def get_renderables(self):
            yield self.make_tasks_table(self.tasks)
            for task in self.tasks:
                if task.fields.get("stats"):
                    yield Text.from_markup(task.fields["stats"], overflow="fold")

    return StatsProgress(*columns, **kwargs)


class Display:
    """Live progress: ``mode`` is 'rich', 'plain', 'none' or 'auto' (rich on a terminal).
    ``console``: the rich console to draw on (default: the terminal's). ``count``: the number
    shown for a step (the Python API shows TRL's optimizer steps, as its log_history counts);
    default: the step itself. ``show_kl`` False (``algo.beta`` 0: no reference, so no KL is
    measured) leaves the kl field off the line, instead of "kl -" on a skipped update and
    "kl 0.0000" on the others."""

    COLUMNS = [
        ("reward", "reward/total/mean", ".3f"),
        ("acc", "reward/accuracy", ".3f"),
        ("kl", "kl/mean", ".4f"),
        ("len", "rollout/len_mean", ".1f"),
        ("tok/s", "perf/tokens_per_s", ".0f"),
    ]

    def __init__(
        self,
        mode: str,
        total_steps: int,
        start_step: int = 0,
        title: str = "peergrade",
        console=None,
        count=None,
        show_kl: bool = True,
        main: bool = True,
    ):
        self.main = main  # False on ranks other than 0: they show nothing, not even stop lines
        self.columns = [c for c in self.COLUMNS if show_kl or c[0] != "kl"]
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        self.mode = mode
        self.count = count or (lambda step: step)
        self.total = total_steps
        self.start_step = start_step
        self.t0 = time.perf_counter()
        self.title = title
        self._live = None
        self._progress = None
        self._alerts: set[str] = set()  # active last step: a message is printed when one starts
        # reward/accuracy: "acc" (a share correct) while every score has been 0 or 1
        self.acc_label = "acc"
        if mode == "rich":
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeRemainingColumn,
            )

            self.console = console or Console()
            self._progress = _stats_progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(bar_width=None),  # what the line has left: it gives way first
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task(
                title, total=self.count(total_steps), completed=self.count(start_step), stats=""
            )
            self._progress.start()

    def print(self, text: str, *, always: bool = False, literal: bool = False) -> None:
        """Show a message; ``always`` ones (interrupts, skipped evals) reach stderr even with mode none.
        ``literal``: text that is not rich markup (a rendered prompt may hold ``[/INST]``)."""
        if self.mode == "none":
            if always and self.main:
                print(text, file=sys.stderr, flush=True)
            return
        if self.mode == "rich":
            self.console.print(_escape(text) if literal else text)
        else:
            print(text, flush=True)

    def partial_scores(self) -> None:
        """The scorer gave a score other than 0 or 1: ``reward/accuracy`` is a mean score, not
        a share correct, and the progress line calls it ``score`` from now on."""
        self.acc_label = "score"

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        stats = "  ".join(
            f"{self.acc_label if key == 'reward/accuracy' else name} {_fmt(metrics.get(key), spec)}"
            for name, key, spec in self.columns
        )
        stats += _error_note(metrics) + _harness_note(metrics)
        alerts = self.show_alerts(step, metrics)
        if alerts:
            stats += "  " + (
                f"[yellow]alerts: {', '.join(alerts)}[/]"
                if self.mode == "rich"
                else f"alerts: {', '.join(alerts)}"
            )
        if self.mode == "rich":
            self._progress.update(self._task, completed=self.count(step), stats=stats)
        elif self.mode == "plain":
            done = step - self.start_step
            elapsed = time.perf_counter() - self.t0
            eta = elapsed / max(done, 1) * (self.total - step)
            shown = f"{self.count(step)}/{self.count(self.total)}"
            print(f"step {shown}  {stats}  eta {_eta(eta)}", flush=True)

    def show_alerts(self, step: int, metrics: dict[str, Any]) -> dict[str, str]:
        """Print the message of each alert in ``metrics`` that was not active on the previous
        line; returns the active alerts."""
        alerts = metrics.get("alerts") or {}
        for name, message in alerts.items():
            if name not in self._alerts:
                # even with display none: a user who silenced progress still needs to know
                self.print(
                    f"[bold yellow]alert[/] step {self.count(step)}: {_escape(message)}"
                    if self.mode == "rich"
                    else f"[alert] step {self.count(step)}: {message}",
                    always=True,
                )
        self._alerts = set(alerts)
        return alerts

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def table(self, title: str, header: list[str], rows: list[list[str]]) -> None:
        """A small table (e.g. before/after accuracy): rich when available, else aligned text."""
        if self.mode == "none":
            return
        if self.mode == "rich":
            from rich.table import Table

            t = Table(title=title)
            for h in header:
                t.add_column(h)
            for r in rows:
                t.add_row(*r)
            self.console.print(t)
            return
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
        print(title, flush=True)
        for r in [header, *rows]:
            print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)), flush=True)


class Tee:
    """A metrics log that also hands every line to a caller's ``on_log`` (the Python API)."""

    def __init__(self, log, on_log):
        self.log, self.on_log = log, on_log

    def write(self, line: dict) -> None:
        self.log.write(line)
        self.on_log(dict(line))

    def close(self) -> None:
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
