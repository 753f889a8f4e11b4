"""What a user watches: metrics.jsonl, samples.jsonl and the live progress display.

``JsonlWriter`` appends one JSON object per line and flushes it, so a crash loses at most the
line being written. ``Display`` shows the run: a rich live panel in an interactive terminal
(step, reward, accuracy, KL, completion length, tokens/s, ETA), plain one-line-per-step output
otherwise (CI logs, pipes), or nothing. TensorBoard is fed when ``tensorboard`` is installed and
asked for; it is never required.

Metric names are namespaced (``reward/<fn>/mean``, ``loss/policy``, ``rollout/len_mean``,
``perf/tokens_per_s``, ``time/generate_s``). This module computes no metric itself.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any


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


class Display:
    """Live progress: ``mode`` is 'rich', 'plain', 'none' or 'auto' (rich on a terminal)."""

    COLUMNS = [
        ("reward", "reward/total/mean", ".3f"),
        ("acc", "reward/accuracy", ".3f"),
        ("kl", "kl/mean", ".4f"),
        ("len", "rollout/len_mean", ".1f"),
        ("tok/s", "perf/tokens_per_s", ".0f"),
    ]

    def __init__(self, mode: str, total_steps: int, start_step: int = 0, title: str = "peergrade"):
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        self.mode = mode
        self.total = total_steps
        self.start_step = start_step
        self.t0 = time.perf_counter()
        self.title = title
        self._live = None
        self._progress = None
        if mode == "rich":
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self.console = Console()
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task(
                title, total=total_steps, completed=start_step, stats=""
            )
            self._progress.start()

    def print(self, text: str, *, always: bool = False) -> None:
        """Show a message; ``always`` ones (interrupts, skipped evals) reach stderr even with mode none."""
        if self.mode == "none":
            if always:
                print(text, file=sys.stderr, flush=True)
            return
        if self.mode == "rich":
            self.console.print(text)
        else:
            print(text, flush=True)

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        stats = "  ".join(
            f"{name} {_fmt(metrics.get(key), spec)}" for name, key, spec in self.COLUMNS
        ) + _error_note(metrics)
        if self.mode == "rich":
            self._progress.update(self._task, completed=step, stats=stats)
        elif self.mode == "plain":
            done = step - self.start_step
            elapsed = time.perf_counter() - self.t0
            eta = elapsed / max(done, 1) * (self.total - step)
            print(f"step {step}/{self.total}  {stats}  eta {_eta(eta)}", flush=True)

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
