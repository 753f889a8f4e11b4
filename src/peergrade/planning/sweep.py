"""``peergrade sweep``: train the same config with one or more keys varied, then compare.

What it does
------------
``parse_sets(["rollout.group_size=2,4,8"])`` reads the axes; several ``--set`` give the full grid
(every combination, in the order given). ``run_sweep`` trains each variant one after another
with the same seed and the same number of steps, each in its own run directory under the sweep
directory, through the ``train`` function it is handed (the CLI passes ``trainer.train``: this
module never imports the trainer, so there is one training step, not a copy). ``sweep.json``
lists each variant as it starts and is updated when it ends, so a killed sweep still reports
what finished and the partial run it was in.

``summarize(runs)`` compares the variants from their run directories alone:

* held-out accuracy (``eval/<metric>``, default ``pass@1_sampled``) at each evaluation, against
  the training time so far and against the completions generated so far. Training time is
  the sum of the generate + reward + reference + update times of the steps, which leaves out
  held-out evaluation, so variants with other eval settings compare;
* the noise of the advantage estimate: every completion's advantage is measured against its
  group's mean reward, an estimate from G samples. Its standard error in one group is
  ``s / sqrt(G)`` (``s``: the sample standard deviation of the group's rewards, ``ddof=1``);
  ``baseline_se`` is the root mean square of that over the groups logged in samples.jsonl,
  i.e. the typical error of the baseline each advantage is measured against. Also reported:
  the mean fraction of groups with zero reward spread (no learning signal);
* the best variant: the highest final held-out accuracy; ties go to the one with less training
  time. With ``time_budget_s`` it is the highest accuracy evaluated within that training time.

What it deliberately does not do
--------------------------------
No parallel runs (one device, one run at a time), no search strategy beyond the grid, no
repeated seeds (run the sweep again with another ``--seed`` to see seed noise).
"""

from __future__ import annotations

import html
import itertools
import json
import math
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from peergrade.errors import InputError
from peergrade.monitoring.report import (
    COLORS,
    RunLogs,
    Section,
    _table,
    completions_per_step,
    line_figure,
    train_seconds,
)
from peergrade.training.run_lock import LOCK_NAME  # the sweep directory's lock is no content

__all__ = [
    "parse_sets",
    "grid",
    "variant_name",
    "run_sweep",
    "summarize",
    "sweep_section",
    "baseline_se",
]


def _split_values(text: str) -> list[str]:
    """Comma-separated values; commas inside [...] or {...} belong to the value."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [v.strip() for v in out]


def parse_sets(specs: list[str]) -> list[tuple[str, list[Any]]]:
    """``["rollout.group_size=2,4,8", "optim.lr=1e-3,3e-4"]`` -> ``[(key, [values...]), ...]``."""
    from peergrade.config import all_keys, parse_override_value

    keys = all_keys()
    axes = []
    for spec in specs:
        if "=" not in spec:
            raise InputError(
                f"--set {spec!r}: expected KEY=V1,V2,... (e.g. rollout.group_size=2,4,8)"
            )
        key, text = spec.split("=", 1)
        key = key.strip().removeprefix("--")
        if key not in keys:
            raise InputError(
                f"--set {spec!r}: {key!r} is not a config key (see `peergrade config`)"
            )
        values = _split_values(text)
        if not values or any(v == "" for v in values):
            raise InputError(f"--set {spec!r}: empty value in the list")
        if any(k == key for k, _ in axes):
            raise InputError(f"--set {key} given twice")
        axes.append((key, [parse_override_value(v) for v in values]))
    if not axes:
        raise InputError("sweep: give at least one --set KEY=V1,V2,...")
    return axes


def grid(axes: list[tuple[str, list[Any]]]) -> list[list[tuple[str, Any]]]:
    """Every combination of the axes' values, first axis slowest."""
    keys = [k for k, _ in axes]
    return [list(zip(keys, combo)) for combo in itertools.product(*(v for _, v in axes))]


def variant_name(overrides: list[tuple[str, Any]]) -> str:
    """``[("rollout.group_size", 4)]`` -> ``group_size=4``: a folder name for the variant."""
    parts = []
    for key, value in overrides:
        v = json.dumps(value) if not isinstance(value, str) else value
        parts.append(f"{key.split('.')[-1]}={v}")
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", "_".join(parts))


def run_sweep(
    *,
    load: Callable[[list[tuple[str, Any]]], Any],
    axes: list[tuple[str, list[Any]]],
    out_dir: Path,
    train: Callable[..., dict],
    overwrite: bool = False,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Train every variant into ``out_dir/<name>``. ``load(overrides)`` returns the Config of
    a variant (the CLI's config file + command-line overrides + the variant's values);
    ``train(cfg, run_dir, overwrite=...)`` is the trainer's entry point. All configs are built
    (and so validated) before the first run starts, so a bad value fails at once."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(p.name != LOCK_NAME for p in out_dir.iterdir()) and not overwrite:
        raise InputError(
            f"{out_dir}: sweep directory exists and is not empty (pass --overwrite, or -o NEW_DIR)"
        )
    variants = []
    for ov in grid(axes):
        name = variant_name(ov)
        cfg = load(ov)
        variants.append((name, ov, cfg))
    out_dir.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    axes_json = [[k, v] for k, v in axes]
    for i, (name, ov, cfg) in enumerate(variants, 1):
        run_dir = out_dir / name
        log(f"[{i}/{len(variants)}] {name}: training into {run_dir}")
        # listed before it starts, so a sweep killed mid-variant still reports that partial run
        entry = {"name": name, "overrides": dict(ov), "run_dir": name, "status": "running"}
        results.append(entry)
        _write_json(out_dir / "sweep.json", {"axes": axes_json, "variants": results})
        t0 = time.perf_counter()
        summary = train(cfg, run_dir, overwrite=overwrite)
        entry["wall_s"] = time.perf_counter() - t0
        entry["interrupted"] = bool(summary.get("interrupted"))
        entry["status"] = "interrupted" if entry["interrupted"] else "done"
        _write_json(out_dir / "sweep.json", {"axes": axes_json, "variants": results})
        if entry["interrupted"]:
            log("sweep interrupted; the finished variants are kept")
            break
    return results


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    tmp.replace(path)


def read_sweep(sweep_dir: Path) -> tuple[list[Path], dict]:
    """The run dirs a sweep directory lists in its sweep.json (those that exist)."""
    sweep_dir = Path(sweep_dir)
    try:
        info = json.loads((sweep_dir / "sweep.json").read_text())
        names = [v["run_dir"] for v in info["variants"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{sweep_dir}/sweep.json: not a sweep summary ({e})") from None
    return [sweep_dir / n for n in names if (sweep_dir / n).is_dir()], info


# ----------------------------------------------------------------------------- analysis


def baseline_se(samples: list[dict]) -> tuple[float, int]:
    """RMS over logged groups of ``s / sqrt(G)`` (see the module docstring), and the number of
    groups used (groups with fewer than 2 finite rewards are left out)."""
    total, n = 0.0, 0
    for s in samples:
        r = [x for x in s.get("rewards") or [] if isinstance(x, (int, float)) and math.isfinite(x)]
        G = len(r)
        if G < 2:
            continue
        mean = sum(r) / G
        var = sum((x - mean) ** 2 for x in r) / (G - 1)
        total += var / G
        n += 1
    return (math.sqrt(total / n) if n else float("nan")), n


def _eval_points(run: RunLogs, metric: str) -> list[tuple[int, float, int, float]]:
    """(step, training seconds, completions, accuracy) at each held-out evaluation."""
    key = f"eval/{metric}"
    rows = run.train_rows
    secs = train_seconds(rows)
    t_at = {int(m["step"]): s for m, s in zip(rows, secs)}
    cps = completions_per_step(run) or 0
    pts = []
    for m in run.metrics:
        v = m.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            step = int(m.get("step", 0))
            t = t_at.get(step, 0.0 if step == 0 else max(t_at.values(), default=0.0))
            pts.append((step, t, step * cps, float(v)))
    return pts


def summarize(
    runs: list[RunLogs], *, metric: str = "pass@1_sampled", time_budget_s: float | None = None
) -> dict:
    """Per variant: final accuracy, training time, completions, baseline noise; and the best."""
    rows = []
    for run in runs:
        pts = _eval_points(run, metric)
        se, n_groups = baseline_se(run.samples)
        zero = [
            m["rollout/frac_zero_std_groups"]
            for m in run.train_rows
            if isinstance(m.get("rollout/frac_zero_std_groups"), (int, float))
        ]
        secs = train_seconds(run.train_rows)
        within = [p for p in pts if time_budget_s is None or p[1] <= time_budget_s]
        rows.append(
            {
                "name": run.name,
                "group_size": (run.config.get("rollout") or {}).get("group_size"),
                "steps": run.last_step,
                "finished": run.finished,
                "train_s": secs[-1] if secs else 0.0,
                "completions": (completions_per_step(run) or 0) * run.last_step,
                "acc_before": pts[0][3] if pts else None,
                "acc_final": pts[-1][3] if pts else None,
                "acc_in_budget": within[-1][3] if within else None,
                "baseline_se": se,
                "groups_logged": n_groups,
                "zero_signal_frac": sum(zero) / len(zero) if zero else None,
                "points": pts,
            }
        )
    scored = [r for r in rows if r["acc_in_budget"] is not None]
    best = None
    if scored:
        best = max(scored, key=lambda r: (r["acc_in_budget"], -r["train_s"]))["name"]
    return {"metric": metric, "time_budget_s": time_budget_s, "variants": rows, "best": best}


def _num(x, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_summary(s: dict) -> str:
    """The sweep's comparison as plain text, ending with the best variant."""
    m = s["metric"]
    header = [
        "variant",
        "steps",
        "train s",
        "completions",
        f"{m} before",
        f"{m} after",
        "baseline se",
        "groups",
        "zero-signal",
    ]
    cells = [header]
    for r in s["variants"]:
        cells.append(
            [
                r["name"],
                str(r["steps"]),
                _num(r["train_s"], ".1f"),
                str(r["completions"]),
                _num(r["acc_before"]),
                _num(r["acc_final"]),
                _num(r["baseline_se"]),
                str(r["groups_logged"]),
                _num(r["zero_signal_frac"]),
            ]
        )
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if s["best"]:
        budget = (
            f"within {s['time_budget_s']:.0f} s of training"
            if s["time_budget_s"]
            else "at the same number of steps"
        )
        lines.append(f"best {m} {budget}: {s['best']}")
    else:
        lines.append(f"no held-out {m} logged: no best variant named")
    return "\n".join(lines)


def _accuracy_figures(s: dict) -> list[str]:
    """Held-out accuracy vs training time and vs completions generated, one line per variant."""
    m = s["metric"]
    acc_t, acc_c = [], []
    for i, r in enumerate(s["variants"]):
        pts = r["points"]
        if not pts:
            continue
        kw = {"color": COLORS[i % len(COLORS)], "marker": "o", "markersize": 3}
        acc_t.append((r["name"], [p[1] for p in pts], [p[3] for p in pts], kw))
        acc_c.append((r["name"], [p[2] for p in pts], [p[3] for p in pts], kw))
    figs = []
    if acc_t:
        figs.append(
            line_figure(
                acc_t, title=f"Held-out {m} vs training time", xlabel="training time (s)", ylabel=m
            )
        )
        figs.append(
            line_figure(
                acc_c,
                title=f"Held-out {m} vs completions generated",
                xlabel="completions",
                ylabel=m,
            )
        )
    return figs


def _noise_figure(s: dict) -> str | None:
    """The group-mean baseline's standard error vs group size, when the variants differ in G."""
    noise = [
        (r["group_size"], r["baseline_se"])
        for r in s["variants"]
        if isinstance(r["group_size"], int) and not math.isnan(r["baseline_se"])
    ]
    if len({g for g, _ in noise}) <= 1:
        return None
    noise.sort()
    return line_figure(
        [
            (
                "baseline s.e. (RMS over logged groups)",
                [g for g, _ in noise],
                [v for _, v in noise],
                {"marker": "o", "color": COLORS[0]},
            )
        ],
        title="Noise of the group-mean baseline vs group size",
        xlabel="group size G",
        ylabel="s / sqrt(G)",
        logx=True,
    )


def _variants_table(s: dict) -> str:
    """One row per variant: budget spent, accuracy before and after, baseline noise."""
    m = s["metric"]
    return _table(
        [
            "variant",
            "steps",
            "train s",
            "completions",
            f"{m} before",
            f"{m} final",
            "baseline s.e.",
            "zero-signal frac",
        ],
        [
            [
                html.escape(r["name"]) + (" <b>(best)</b>" if r["name"] == s["best"] else ""),
                str(r["steps"]),
                f"{r['train_s']:.1f}",
                str(r["completions"]),
                "-" if r["acc_before"] is None else f"{r['acc_before']:.3f}",
                "-" if r["acc_final"] is None else f"{r['acc_final']:.3f}",
                "-" if math.isnan(r["baseline_se"]) else f"{r['baseline_se']:.3f}",
                "-" if r["zero_signal_frac"] is None else f"{r['zero_signal_frac']:.3f}",
            ]
            for r in s["variants"]
        ],
        "sweep",
    )


def sweep_section(runs: list[RunLogs], s: dict) -> Section:
    """The report section: the table, accuracy vs training time and vs completions, and the
    baseline noise per variant."""
    figs = _accuracy_figures(s)
    noise = _noise_figure(s)
    if noise is not None:
        figs.append(noise)
    fig_html = (
        '<div class="grid">'
        + "".join(
            f'<figure class="plot" data-panel="sweep {i}">{svg}</figure>'
            for i, svg in enumerate(figs)
        )
        + "</div>"
    )
    best = html.escape(format_summary(s).splitlines()[-1])
    table = _variants_table(s)
    expl = (
        '<p class="muted">Training time: generate + reward + reference + update, evaluation left out. '
        "Baseline s.e.: each advantage is measured against its group's mean reward, an estimate "
        "from G samples whose standard error is s/&radic;G (s: the group's reward standard "
        "deviation); shown is its root mean square over the groups in samples.jsonl.</p>"
    )
    return Section("Sweep", f"<p><b>{best}</b></p>" + table + expl + fig_html, "sweep")
