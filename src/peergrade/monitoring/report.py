"""The HTML run report: one self-contained file with plots, the config and the sampled groups.

What it does
------------
``load_run(dir)`` reads a run directory (``config.yaml``, ``metrics.jsonl``, ``samples.jsonl``)
as written by ``peergrade train``, tolerating a run that is still going or was killed: a
truncated last line is dropped (and said so), a damaged line in the middle is skipped with a
note naming the file and line. ``write_report(runs, out)`` renders one HTML file:

* a summary per run (steps logged, finished or not, training time, completions generated,
  held-out accuracy before/after), and any ``alert/*`` metrics the run logged;
* plots (matplotlib, inlined as SVG) of reward per function, held-out accuracy (``eval/*``),
  KL, entropy, completion length, zero-signal fraction, clip fractions, importance ratio,
  the off-policy correction's weights, tokens/s, time per phase, losses and gradient norms;
  and, only for runs that logged them (``OPTIONAL_PANELS``): dynamic sampling's rounds and
  unfilled groups, the staleness of pipelined rollouts, the tokens the correction masked or
  truncated, model FLOP/s per phase, and tool use (calls and failed calls per episode).
  Several runs are overlaid, one colour
  each. A noisy per-step curve is drawn faint with its exponential moving average on top (as
  TensorBoard smooths). A panel whose metric is constant by construction for a run (KL with
  ``algo.beta`` 0, the importance ratio and clip fractions with one optimizer step per batch)
  is not drawn for it: the page says why instead of showing a flat line;
* the resolved ``config.yaml`` of each run and the keys that differ between runs;
* a searchable table of the sampled groups in ``samples.jsonl``: the prompt as the model saw
  it (``prompt_rendered``: chat template and system prompt applied; the row's own prompt
  under it), each completion with its total reward, per-function rewards when logged, advantage and finish reason.
  An episode (a completion logged as a message list: tools, environments) is shown turn by
  turn, each labelled with its role (a tool turn with the tool's name, an assistant turn with
  the calls it made); the turns the model did not sample (tool and environment messages,
  masked out of the loss) are greyed and marked "not trained on".

Extra sections (a sweep comparison, a memory chart) are passed in as ``Section`` objects built
by their own modules with the helpers here (``figure_svg``, ``memory_chart``).

The page opens with no network: no external script, style, font or image; a Content Security
Policy meta tag (``default-src 'none'``) makes the browser refuse any request the page might
still try. The search box is a few lines of inline JavaScript.

What it deliberately does not do
--------------------------------
It computes no training metric (those come from the trainer) and never imports the trainer
or model code; it does not watch a run live (re-run it to refresh) and does not serve pages.
"""

from __future__ import annotations

import html
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peergrade.errors import InputError, require
from peergrade.files import atomic_write_text, read_jsonl

__all__ = [
    "RunLogs",
    "Section",
    "load_run",
    "is_run_dir",
    "figure_svg",
    "line_figure",
    "memory_chart",
    "render_report",
    "write_report",
    "PANELS",
    "OPTIONAL_PANELS",
    "CONSTANT_BY_CONSTRUCTION",
    "ema",
]

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'"
# groups per run in the completions table; beyond it, evenly spaced steps are kept
MAX_GROUPS_PER_RUN = 1500


@dataclass
class RunLogs:
    """One run directory, read."""

    path: Path
    name: str
    config_text: str
    config: dict
    metrics: list[dict]
    samples: list[dict]
    notes: list[str] = field(default_factory=list)

    @property
    def train_rows(self) -> list[dict]:
        """Metric rows of training steps (the eval-only rows at step 0 and the end excluded)."""
        return [m for m in self.metrics if "time/step_s" in m or "loss/policy" in m]

    @property
    def finished(self) -> bool:
        return any(m.get("final") for m in self.metrics)

    @property
    def last_step(self) -> int:
        rows = self.train_rows
        return int(rows[-1]["step"]) if rows else 0

    def eval_rows(self) -> list[dict]:
        return [m for m in self.metrics if any(k.startswith("eval/") for k in m)]


@dataclass
class Section:
    """A block of the report: a title and its inner HTML (already escaped)."""

    title: str
    html: str
    anchor: str = ""


# ----------------------------------------------------------------------------- reading


def is_run_dir(path: Path) -> bool:
    path = Path(path)
    return path.is_dir() and ((path / "metrics.jsonl").exists() or (path / "config.yaml").exists())


def load_run(path: Path, name: str | None = None) -> RunLogs:
    """Read a run directory; raises ``InputError`` naming the path when it is not one."""
    import yaml

    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such run directory")
    if not path.is_dir():
        raise InputError(f"{path}: not a directory (expected a run directory from peergrade train)")
    if not is_run_dir(path):
        raise InputError(
            f"{path}: not a peergrade run directory (expected config.yaml and metrics.jsonl "
            "as written by `peergrade train`)"
        )
    notes: list[str] = []
    config_text = ""
    config: dict = {}
    if (path / "config.yaml").exists():
        config_text = (path / "config.yaml").read_text(encoding="utf-8", errors="replace")
        try:
            loaded = yaml.safe_load(config_text)
            config = loaded if isinstance(loaded, dict) else {}
        except yaml.YAMLError as e:
            notes.append(f"config.yaml does not parse as YAML ({e}); shown as text only")
    else:
        notes.append("no config.yaml")
    metrics = read_jsonl(path / "metrics.jsonl", notes)
    samples = read_jsonl(path / "samples.jsonl", notes)
    if not metrics:
        notes.append("metrics.jsonl has no rows yet")
    return RunLogs(path, name or path.name, config_text, config, metrics, samples, notes)


def unique_names(paths: list[Path]) -> list[str]:
    """Short labels for run dirs: the folder name, with parents added until they differ."""
    paths = [Path(p).resolve() for p in paths]
    depth = 1
    while True:
        names = ["/".join(p.parts[-depth:]) for p in paths]
        if len(set(names)) == len(names) or depth > 8:
            return names
        depth += 1


# ----------------------------------------------------------------------------- plots

# (title, y label, key patterns). A pattern is a regex over metric names; each match is a line.
PANELS: list[tuple[str, str, list[str]]] = [
    ("Reward per function", "mean reward", [r"reward/.+/mean", r"reward/accuracy"]),
    ("Held-out accuracy", "accuracy", [r"eval/(?!n$|k$).+"]),
    ("KL to the reference", "KL", [r"kl/mean", r"loss/kl"]),
    ("Entropy", "nats / token", [r"entropy/mean"]),
    ("Completion length", "tokens", [r"rollout/len_mean", r"rollout/len_max"]),
    (
        "Zero-signal and truncated fractions",
        "fraction",
        [
            r"rollout/frac_zero_std_groups",
            r"dynamic/frac_zero_std_groups_sampled",
            r"update/zero_signal_frac",
            r"rollout/frac_truncated",
        ],
    ),
    (
        "Dynamic sampling",
        "rounds / groups / completions",
        [r"dynamic/(rounds|sampling_calls|unfilled_groups|completions_per_informative_group)"],
    ),
    (
        "Tool use",
        "per episode / fraction",
        [r"tools/call_frequency", r"tools/failure_frequency", r"turns/mean"],
    ),
    ("Clip fractions", "fraction", [r"clip/.+", r"value/clip_frac"]),
    ("Importance ratio", "ratio", [r"ratio/.+"]),
    ("Staleness of the rollouts", "policy versions", [r"async/staleness.*"]),
    ("Off-policy correction", "weight", [r"correction/weight.*"]),
    ("Tokens masked or truncated by the correction", "fraction", [r"correction/.*frac.*"]),
    ("Tokens per second", "tokens / s", [r"perf/(?!.+_tflops$).+"]),
    ("Model FLOP/s per phase", "TFLOP/s", [r"perf/.+_tflops"]),
    ("Time per phase", "seconds", [r"time/.+_s"]),
    (
        "Losses and gradient norm",
        "value",
        [r"loss/(?!kl$).+", r"grad/.+", r"value/(?!clip_frac$).+"],
    ),
]


# Panels of what only some runs do (pipelined rollouts, the off-policy correction's masking,
# dynamic sampling, tools and environments) or only newer runs log (model FLOP/s): drawn when a run logged them, and
# otherwise left out without a word, so a synchronous run's page is what it always was.
OPTIONAL_PANELS = frozenset(
    {
        "Dynamic sampling",
        "Staleness of the rollouts",
        "Tokens masked or truncated by the correction",
        "Model FLOP/s per phase",
        "Tool use",
    }
)


def _conf(config: dict, section: str, key: str, default):
    v = (config.get(section) or {}).get(key) if isinstance(config, dict) else None
    return default if v is None else v


def updates_per_step(config: dict) -> int | None:
    """Optimizer steps per training step of a run's resolved config (``algo.num_iterations``
    passes x minibatches per pass); None when the config does not say enough to tell."""
    mu = int(_conf(config, "algo", "num_iterations", 1))
    mb = _conf(config, "optim", "minibatch_size", None)
    if mb is None:  # the whole batch in one optimizer step
        return mu
    P = _conf(config, "rollout", "prompts_per_step", None)
    G = _conf(config, "rollout", "group_size", None)
    if P is None or G is None or int(mb) <= 0:
        return None
    return mu * max(1, int(P) * int(G) // int(mb))


def _no_reference(config: dict) -> bool:
    return float(_conf(config, "algo", "beta", 0.0)) == 0.0


def _one_update(config: dict) -> bool:
    return updates_per_step(config) == 1


_ONE_UPDATE_WHY = (
    "one optimizer step per batch (algo.num_iterations 1, the whole batch in one minibatch): "
    "the policy that scores the tokens is the one that sampled them, so"
)
# Panels whose metric cannot move under some configs: {title: (the config test, why)}. Such a
# panel is not drawn for a run whose config passes the test *and* whose logged values are all
# one value; the page says why instead (a flat line reads as "nothing happened").
CONSTANT_BY_CONSTRUCTION: dict[str, tuple[Any, str]] = {
    "KL to the reference": (
        _no_reference,
        "algo.beta is 0: no reference model is loaded and no KL is computed (kl/mean is logged "
        "as 0). Set algo.beta > 0 to penalise and watch the distance to the reference.",
    ),
    "Importance ratio": (
        _one_update,
        f"{_ONE_UPDATE_WHY} the ratio is exactly 1 on every token. It moves with "
        "algo.num_iterations > 1 or optim.minibatch_size below the batch.",
    ),
    "Clip fractions": (
        _one_update,
        f"{_ONE_UPDATE_WHY} every ratio is 1 and nothing is clipped. Clipping acts with "
        "algo.num_iterations > 1 or optim.minibatch_size below the batch.",
    ),
}


def ema(ys: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased at the start (the
    first points are not pulled toward 0)."""
    out, last = [], 0.0
    for i, y in enumerate(ys, start=1):
        last = last * weight + (1.0 - weight) * y
        out.append(last / (1.0 - weight**i))
    return out


def is_noisy(ys: list[float]) -> bool:
    """A per-step curve worth smoothing: 10+ points whose path is over 3 times as long as a
    monotone path across the same range (white noise of n points scores about n / 5; a trend,
    however steep, scores 1)."""
    if len(ys) < 10:
        return False
    span = max(ys) - min(ys)
    path = sum(abs(b - a) for a, b in zip(ys, ys[1:]))
    return span > 0 and path > 3 * span


def smoothing_weight(n: int) -> float:
    """The EMA weight for a curve of ``n`` points: an effective window of about n / 20 points
    (TensorBoard's slider, set by length), between 0.6 (TensorBoard's default) and 0.98."""
    return min(0.98, max(0.6, 1.0 - 20.0 / max(n, 1)))


COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"]
STYLES = ["-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1))]


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def figure_svg(fig) -> str:
    """A matplotlib figure as inline SVG (no XML header, no metadata block with its URLs)."""
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    svg = buf.getvalue()
    svg = svg[svg.index("<svg") :]
    # the RDF metadata names its schemas by URL; harmless, but the page should hold no URLs
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
    # inline in HTML the parser puts <svg> and xlink:href in their namespaces by itself
    svg = re.sub(r'\s+xmlns(:xlink)?="[^"]*"', "", svg)
    return svg


def _mpl():
    matplotlib = require(
        "matplotlib", needed_for="the HTML report's plots", pip="matplotlib", extra="report"
    )

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {"svg.fonttype": "none", "font.size": 9, "axes.grid": True, "grid.alpha": 0.3}
    )
    return plt


def line_figure(
    series: list[tuple[str, list[float], list[float], dict]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    size=(6.0, 3.2),
    logx: bool = False,
) -> str:
    """series = [(label, xs, ys, matplotlib line kwargs)] -> inline SVG."""
    plt = _mpl()
    fig, ax = plt.subplots(figsize=size)
    for label, xs, ys, kw in series:
        ax.plot(xs, ys, label=label, **{"linewidth": 1.4, **kw})
    ax.set_title(title)
    if xlabel == "step":
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logx:  # e.g. group sizes 2, 4, 8, 16: ticks at the values, written plainly
        from matplotlib.ticker import NullFormatter, ScalarFormatter

        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({x for _, xs, _, _ in series for x in xs}))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
    if len(series) > 1 or (series and series[0][0]):
        ax.legend(fontsize=7, loc="best")
    return figure_svg(fig)


def constant_runs(runs: list[RunLogs], title: str, patterns: list[str]) -> list[RunLogs]:
    """The runs whose metrics in this panel are constant by construction (their config says
    so, see ``CONSTANT_BY_CONSTRUCTION``, and every value they logged there is one value)."""
    if title not in CONSTANT_BY_CONSTRUCTION:
        return []
    test, _ = CONSTANT_BY_CONSTRUCTION[title]
    out = []
    for run in runs:
        values = {v for _, _, ys, _ in panel_series([run], patterns, smooth=False) for v in ys}
        if values and len(values) == 1 and test(run.config):
            out.append(run)
    return out


def panel_series(
    runs: list[RunLogs], patterns: list[str], *, smooth: bool = True, skip: list[RunLogs] = ()
):
    """Lines of one panel: per run, per metric key matching a pattern, (step, value) points.
    With ``smooth``, a noisy per-step curve (``is_noisy``) comes twice: raw, faint and out of
    the legend, then its EMA (``ema``, ``smoothing_weight``) in the same colour, labelled.
    Runs in ``skip`` keep their colour and draw nothing."""
    out = []
    regexes = [re.compile(p + "$") for p in patterns]
    for ri, run in enumerate(runs):
        if any(run is r for r in skip):
            continue
        keys: list[str] = []
        for m in run.metrics:
            for k in m:
                if k not in keys and any(r.match(k) for r in regexes):
                    keys.append(k)
        for ki, key in enumerate(keys):
            pts = [(m["step"], m[key]) for m in run.metrics if _finite(m.get(key)) and "step" in m]
            if not pts:
                continue
            label = key if len(runs) == 1 else f"{run.name}: {key}"
            if len(runs) == 1:  # one run: a colour per metric
                kw = {"color": COLORS[ki % len(COLORS)]}
            else:  # overlay: a colour per run, a line style per metric
                kw = {"color": COLORS[ri % len(COLORS)], "linestyle": STYLES[ki % len(STYLES)]}
            if key.startswith("eval/") or len(pts) <= 3:
                kw["marker"] = "o"
                kw["markersize"] = 3
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            if smooth and not key.startswith("eval/") and is_noisy(ys):
                w = smoothing_weight(len(ys))
                out.append(("_raw " + label, xs, ys, {**kw, "alpha": 0.25, "linewidth": 0.8}))
                out.append((f"{label} (EMA {w:.2f})", xs, ema(ys, w), kw))
            else:
                out.append((label, xs, ys, kw))
    return out


def plots_section(runs: list[RunLogs]) -> Section:
    figs, missing = [], []
    for title, ylabel, patterns in PANELS:
        flat = constant_runs(runs, title, patterns)
        series = panel_series(runs, patterns, skip=flat)
        if not series and not flat:
            if title not in OPTIONAL_PANELS:
                missing.append(title)
            continue
        note = ""
        if flat:
            who = "" if len(runs) == 1 else ", ".join(r.name for r in flat) + ": "
            note = (
                f'<p class="constant">{html.escape(who)}not drawn, constant by construction: '
                f"{html.escape(CONSTANT_BY_CONSTRUCTION[title][1])}</p>"
            )
        if not series:  # nothing left to draw: the reason takes the figure's place
            figs.append(
                f'<figure class="note" data-panel="{html.escape(title)}">'
                f"<h3>{html.escape(title)}</h3>{note}</figure>"
            )
            continue
        svg = line_figure(series, title=title, xlabel="step", ylabel=ylabel)
        caption = ""
        if any(label.startswith("_raw ") for label, *_ in series):
            caption = (
                '<figcaption class="muted">Faint: the values of each step; bold: their '
                "exponential moving average (debiased, as TensorBoard smooths; weight in the "
                "legend).</figcaption>"
            )
        figs.append(
            f'<figure class="plot" data-panel="{html.escape(title)}">{svg}{caption}{note}</figure>'
        )
    body = '<div class="grid">' + "".join(figs) + "</div>"
    if missing:
        body += f'<p class="muted">Not logged in these runs: {html.escape(", ".join(missing))}.</p>'
    return Section("Training curves", body, "plots")


# ----------------------------------------------------------------------------- tables


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return "-" if v is None else str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return "-"
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    return html.escape(str(v))


def _table(header: list[str], rows: list[list[str]], cls: str = "") -> str:
    h = "".join(f"<th>{html.escape(x)}</th>" for x in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>'


def _cfg(run: RunLogs, *keys, default=None):
    node: Any = run.config
    for k in keys:
        if not isinstance(node, dict) or k not in node:
            return default
        node = node[k]
    return node


def step_train_seconds(m: dict) -> float | None:
    """One step's training time, held-out evaluation and logging left out. A synchronous step is
    the sum of its phases (generate + reward + reference + update). A pipelined one
    (``rollout.async_steps``, which logs ``time/wait_s``) overlaps generation with the update, so
    its phases do not add up: it is the step's wall time less its evaluation (``time/eval_s``)."""
    parts = [m.get(k) for k in ("time/generate_s", "time/reward_s", "time/ref_s", "time/update_s")]
    if "time/wait_s" not in m and all(_finite(p) for p in parts):
        return sum(parts)
    if _finite(m.get("time/step_s")):
        return m["time/step_s"] - (m.get("time/eval_s") or 0.0)
    return None


def train_seconds(rows: list[dict]) -> list[float]:
    """Cumulative training time of the steps (``step_train_seconds``), so runs with other eval
    settings, synchronous or pipelined, compare."""
    out, total = [], 0.0
    for m in rows:
        t = step_train_seconds(m)
        total += t or 0.0
        out.append(total)
    return out


def completions_per_step(run: RunLogs) -> int | None:
    P = _cfg(run, "rollout", "prompts_per_step")
    G = _cfg(run, "rollout", "group_size")
    return P * G if isinstance(P, int) and isinstance(G, int) else None


def summary_section(runs: list[RunLogs]) -> Section:
    eval_keys: list[str] = []
    for run in runs:
        for m in run.eval_rows():
            for k in m:
                if k.startswith("eval/") and k not in ("eval/n", "eval/k") and k not in eval_keys:
                    eval_keys.append(k)
    header = ["run", "algo", "G", "status", "steps", "train time (s)", "completions"]
    for k in eval_keys:
        header.append(f"{k[5:]} before -> last")
    rows = []
    for run in runs:
        tr = run.train_rows
        total_steps = _cfg(run, "train", "steps")
        if run.finished:
            status = "finished"
        elif tr:
            status = f"stopped or running at step {run.last_step}/{total_steps}"
        else:
            status = "no training step logged yet"
        secs = train_seconds(tr)
        cps = completions_per_step(run)
        row = [
            html.escape(run.name),
            _fmt(_cfg(run, "algo", "name")),
            _fmt(_cfg(run, "rollout", "group_size")),
            html.escape(status),
            str(run.last_step),
            f"{secs[-1]:.1f}" if secs else "-",
            str(cps * run.last_step) if cps else "-",
        ]
        evals = run.eval_rows()
        for k in eval_keys:
            vals = [m[k] for m in evals if _finite(m.get(k))]
            row.append(
                f"{vals[0]:.3f} -> {vals[-1]:.3f}"
                if len(vals) > 1
                else (_fmt(vals[0]) if vals else "-")
            )
        rows.append(row)
    body = _table(header, rows, "summary")
    notes = [(run.name, n) for run in runs for n in run.notes]
    if notes:
        body += (
            '<ul class="notes">'
            + "".join(f"<li>{html.escape(r)}: {html.escape(n)}</li>" for r, n in notes)
            + "</ul>"
        )
    return Section("Runs", body, "runs")


def alerts_section(runs: list[RunLogs]) -> Section | None:
    """``alert/*`` metrics (from the failure-mode detectors) that fired: step, key, value."""
    rows = []
    for run in runs:
        for m in run.metrics:
            for k, v in m.items():
                if not k.startswith("alert/") or v in (None, 0, 0.0, False, "", [], {}):
                    continue
                text = v if isinstance(v, str) else json.dumps(v)
                rows.append(
                    [
                        html.escape(run.name),
                        str(m.get("step", "?")),
                        html.escape(k),
                        html.escape(text),
                    ]
                )
    if not rows:
        return None
    return Section("Alerts", _table(["run", "step", "alert", "value"], rows, "alerts"), "alerts")


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def config_section(runs: list[RunLogs]) -> Section:
    parts = []
    if len(runs) > 1:
        flat = [_flatten(r.config) for r in runs]
        keys = sorted(set().union(*flat))
        diff = [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flat}) > 1]
        if diff:
            rows = [
                [html.escape(k), *(html.escape(json.dumps(f.get(k))) for f in flat)] for k in diff
            ]
            parts.append(
                "<h3>Keys that differ</h3>" + _table(["key", *(r.name for r in runs)], rows)
            )
        else:
            parts.append("<p>The runs' configs are identical.</p>")
    for run in runs:
        parts.append(
            f"<details{' open' if len(runs) == 1 else ''}><summary>{html.escape(run.name)}/config.yaml"
            f"</summary><pre>{html.escape(run.config_text or '(none)')}</pre></details>"
        )
    return Section("Resolved config", "".join(parts), "config")


def _per_fn(sample: dict, G: int) -> dict[str, list]:
    """Per-function rewards of one logged group, whatever the writer called the field: a dict
    of name -> list of G values (e.g. ``rewards_per_fn``), a list of G ``{name: value}`` dicts,
    or keys ``reward/<fn>`` holding lists."""
    out: dict[str, list] = {}
    for k, v in sample.items():
        if (
            isinstance(v, dict)
            and v
            and all(isinstance(x, list) and len(x) == G for x in v.values())
        ):
            out.update({str(n): x for n, x in v.items()})
        elif isinstance(v, list) and len(v) == G and v and all(isinstance(x, dict) for x in v):
            # one {fn: value} per completion
            for name in dict.fromkeys(n for x in v for n in x):
                out[str(name)] = [x.get(name) for x in v]
        elif k.startswith("reward/") and isinstance(v, list) and len(v) == G:
            out[k[len("reward/") :]] = v
    return out


def _is_episode(completion: Any) -> bool:
    """A completion logged as an episode: a list of chat messages (``samples.jsonl`` of a run
    with tools or an environment)."""
    return (
        isinstance(completion, list)
        and bool(completion)
        and all(isinstance(m, dict) and "role" in m for m in completion)
    )


def _episode_html(messages: list[dict]) -> str:
    """An episode turn by turn: assistant turns (sampled, trained on) and the others (tool and
    environment messages: masked out of the loss), each labelled with its role."""
    parts = []
    for m in messages:
        role = str(m.get("role"))
        label = role + (f" · {m['name']}" if role == "tool" and m.get("name") else "")
        content = m.get("content")
        text = content if isinstance(content, str) else json.dumps(content)
        calls = [c.get("function", c) for c in m.get("tool_calls") or [] if isinstance(c, dict)]
        text += "".join(f"\n→ {f.get('name')}({json.dumps(f.get('arguments'))})" for f in calls)
        trained = role == "assistant"
        parts.append(
            f'<div class="turn{"" if trained else " masked"}"><span class="role">'
            f"{html.escape(label)}</span>"
            + ("" if trained else '<span class="mask">not trained on</span>')
            + f"<pre>{html.escape(text)}</pre></div>"
        )
    return "".join(parts)


def _completion_html(completion: Any) -> str:
    if _is_episode(completion):
        return _episode_html(completion)
    return f"<pre>{html.escape(str(completion))}</pre>"


def _fn_cell(per_fn: dict[str, list], i: int) -> str:
    return "<br>".join(f"{html.escape(n)}&nbsp;{_fmt(v[i])}" for n, v in per_fn.items())


def _pick_groups(samples: list[dict]) -> tuple[list[dict], bool]:
    if len(samples) <= MAX_GROUPS_PER_RUN:
        return samples, False
    steps = sorted({s.get("step") for s in samples}, key=lambda x: (x is None, x))
    per_step = max(1, len(samples) // max(len(steps), 1))
    keep_n = max(1, MAX_GROUPS_PER_RUN // per_step)
    stride = len(steps) / keep_n
    keep = {steps[int(i * stride)] for i in range(keep_n)} | {steps[-1]}
    return [s for s in samples if s.get("step") in keep], True


def _prompt_cell(s: dict, G: int) -> str:
    """The group's prompt cell, spanning its G rows: what the model saw, and the answer."""
    ans = s.get("answer")
    # what the model saw (chat template, system prompt), when the run logged it
    seen = s.get("prompt_rendered", s.get("prompt", ""))
    return (
        f'<td rowspan="{G}" class="prompt"><pre>{html.escape(str(seen))}</pre>'
        + (
            '<div class="muted">the model saw this; the row\'s prompt: '
            f"{html.escape(str(s.get('prompt')))}</div>"
            if "prompt_rendered" in s
            else ""
        )
        + (f'<div class="muted">answer: {html.escape(str(ans))}</div>' if ans is not None else "")
        + "</td>"
    )


def _group_rows(run: RunLogs, s: dict, n: int, any_fn: bool) -> list[str]:
    """The table rows of one logged group (group number ``n``): one per completion."""
    comps = s["completions"]
    G = len(comps)
    rewards = s.get("rewards") if isinstance(s.get("rewards"), list) else [None] * G
    advs = s.get("advantages") if isinstance(s.get("advantages"), list) else [None] * G
    finish = s.get("finish_reason") if isinstance(s.get("finish_reason"), list) else [""] * G
    per_fn = _per_fn(s, G)
    step = s.get("step", "?")
    search = " ".join(str(x) for x in [s.get("prompt", ""), s.get("answer", ""), *comps])
    rows_html = []
    for i, c in enumerate(comps):
        a = advs[i] if i < len(advs) else None
        cls = "pos" if _finite(a) and a > 0 else ("neg" if _finite(a) and a < 0 else "")
        head = _prompt_cell(s, G) if i == 0 else ""
        rows_html.append(
            f'<tr class="g{n}{" first" if i == 0 else ""}" data-run="{html.escape(run.name)}" '
            f'data-step="{html.escape(str(step))}" data-group="{n}" '
            f'data-text="{html.escape(search.lower())}">'
            + (
                f'<td rowspan="{G}">{html.escape(run.name)}</td><td rowspan="{G}">{html.escape(str(step))}</td>'
                if i == 0
                else ""
            )
            + head
            + f"<td>{_completion_html(c)}</td>"
            + f"<td>{_fmt(rewards[i] if i < len(rewards) else None)}</td>"
            + (f"<td>{_fn_cell(per_fn, i)}</td>" if any_fn else "")
            + f'<td class="{cls}">{_fmt(a)}</td>'
            + f"<td>{html.escape(str(finish[i] if i < len(finish) else ''))}</td></tr>"
        )
    return rows_html


def _samples_controls(runs: list[RunLogs], steps_all: set) -> str:
    """The search box and the run and step filters above the samples table."""
    steps_sorted = sorted(
        steps_all, key=lambda x: (not isinstance(x, int), x if isinstance(x, int) else 0)
    )
    opts = "".join(
        f'<option value="{html.escape(str(s))}">{html.escape(str(s))}</option>'
        for s in steps_sorted
    )
    run_opts = "".join(
        f'<option value="{html.escape(r.name)}">{html.escape(r.name)}</option>' for r in runs
    )
    return (
        '<div class="controls"><input id="q" type="search" placeholder="search prompts, answers, completions">'
        f'<label>run <select id="run"><option value="">all</option>{run_opts}</select></label>'
        f'<label>step <select id="step"><option value="">all</option>{opts}</select></label>'
        '<span id="shown"></span></div>'
    )


def _samples_notes(runs: list[RunLogs], thinned: list[str]) -> str:
    """The legends under the filters: how episodes are shown, and which runs were thinned."""
    note = ""
    if any(
        _is_episode(c)
        for run in runs
        for g in run.samples
        if isinstance(g.get("completions"), list)
        for c in g["completions"]
    ):
        note += (
            '<p class="muted" id="episode-legend">Episodes are shown turn by turn. Assistant '
            "turns are what the model sampled and is trained on; the greyed turns marked "
            "<i>not trained on</i> (tool results, environment messages) are tokens it reads "
            "but that are masked out of the loss.</p>"
        )
    if thinned:
        note += (
            f'<p class="muted">Many groups logged in {html.escape(", ".join(thinned))}: '
            f"the table keeps evenly spaced steps (about {MAX_GROUPS_PER_RUN} groups per run).</p>"
        )
    return note


def samples_section(runs: list[RunLogs]) -> Section:
    """The sampled groups of every run as one filterable table (prompt, completions, rewards,
    advantages), thinned to about ``MAX_GROUPS_PER_RUN`` groups per run."""
    # the per-function column only when some group logged per-function rewards
    any_fn = any(
        isinstance(g.get("completions"), list) and _per_fn(g, len(g["completions"]))
        for run in runs
        for g in run.samples
    )
    rows_html = []
    n_groups = 0
    thinned = []
    steps_all: set = set()
    for run in runs:
        groups, thin = _pick_groups(run.samples)
        if thin:
            thinned.append(run.name)
        for s in groups:
            if not isinstance(s.get("completions"), list):
                continue
            steps_all.add(s.get("step", "?"))
            n_groups += 1
            rows_html += _group_rows(run, s, n_groups, any_fn)
    if not n_groups:
        return Section(
            "Sampled groups",
            '<p id="no-samples">No samples logged (samples.jsonl is empty or missing; '
            "set train.log_samples &gt; 0).</p>",
            "samples",
        )
    controls = _samples_controls(runs, steps_all)
    note = _samples_notes(runs, thinned)
    table = (
        f'<table id="samples-table" data-groups="{n_groups}"><thead><tr><th>run</th><th>step</th><th>prompt</th>'
        "<th>completion</th><th>reward</th>"
        + ("<th>per function</th>" if any_fn else "")
        + "<th>advantage</th><th>finish</th>"
        f"</tr></thead><tbody>{''.join(rows_html)}</tbody></table>"
    )
    return Section("Sampled groups", controls + note + table, "samples")


# ----------------------------------------------------------------------------- memory chart


def memory_chart(
    rows: list[tuple[str, dict]], budget_bytes: float | None = None, title: str = ""
) -> str:
    """Grouped bars per variant: the estimated peak of each phase (generate / reference /
    update), in GiB, with the budget as a horizontal line. rows = [(label, estimate)] where
    estimate is ``memory.estimate_memory``'s dict."""
    plt = _mpl()
    phases: list[str] = []
    for _, est in rows:
        for p in est["phases"]:
            if p not in phases:
                phases.append(p)
    fig, ax = plt.subplots(figsize=(6.0, 3.2))
    width = 0.8 / max(len(phases), 1)
    for pi, ph in enumerate(phases):
        xs = [i + (pi - (len(phases) - 1) / 2) * width for i in range(len(rows))]
        ys = [est["phases"].get(ph, 0) / 2**30 for _, est in rows]
        ax.bar(xs, ys, width=width, label=ph, color=COLORS[pi % len(COLORS)])
    if budget_bytes:
        ax.axhline(
            budget_bytes / 2**30,
            color="black",
            linestyle="--",
            linewidth=1.2,
            label=f"budget {budget_bytes / 2**30:.1f} GiB",
        )
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([label for label, _ in rows])
    ax.set_ylabel("estimated peak (GiB)")
    ax.set_title(title or "Estimated peak memory per phase")
    ax.legend(fontsize=7)
    return figure_svg(fig)


# ----------------------------------------------------------------------------- page

STYLE = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0 auto;max-width:1500px;padding:0 18px 40px;color:#222}
h1{font-size:22px;margin:18px 0 4px} h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:3px;margin-top:28px}
nav a{margin-right:12px} .muted{color:#777} pre{margin:0;white-space:pre-wrap;word-break:break-word;font:12px/1.35 ui-monospace,Menlo,Consolas,monospace}
table{border-collapse:collapse;font-size:13px;margin:6px 0} th,td{border:1px solid #ddd;padding:3px 7px;vertical-align:top;text-align:left}
th{background:#f4f4f4;position:sticky;top:0} .grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:10px}
figure{margin:0;border:1px solid #eee;padding:4px} figure svg{width:100%;height:auto}
figure h3{font-size:13px;margin:4px 0} figure p.constant{color:#555;font-size:13px;margin:4px}
td.pos{background:#e6f4e6} td.neg{background:#fbe9e9} td.prompt{max-width:420px;background:#fafafa}
tr.first td{border-top:2px solid #999} .controls{margin:8px 0;display:flex;gap:14px;align-items:center}
.controls input{width:340px;padding:4px} table.alerts td{background:#fff4e5} ul.notes{color:#a15c00}
details pre{background:#fafafa;padding:8px;border:1px solid #eee;max-height:480px;overflow:auto}
.turn{border-left:3px solid #4a7;padding:1px 6px;margin:2px 0} .turn .role{font-size:11px;font-weight:600;color:#4a7}
.turn.masked{border-left-color:#aaa;color:#666;background:repeating-linear-gradient(135deg,#f4f4f4 0 6px,#fff 6px 12px)}
.turn.masked .role{color:#888} .turn .mask{font-size:11px;color:#888;font-style:italic;margin-left:6px}
"""

SCRIPT = """
(function(){
  var q=document.getElementById('q'), run=document.getElementById('run'), step=document.getElementById('step');
  var shown=document.getElementById('shown'), table=document.getElementById("samples-table");
  function apply(){
    if(!table) return;
    var text=(q.value||'').toLowerCase(), r=run.value, s=step.value, groups={}, n=0;
    var rows=table.tBodies[0].rows;
    for(var i=0;i<rows.length;i++){
      var tr=rows[i], g=tr.getAttribute('data-group');
      if(!(g in groups)){
        groups[g]=(!r||tr.getAttribute('data-run')===r)&&(!s||tr.getAttribute('data-step')===s)&&
                  (!text||tr.getAttribute('data-text').indexOf(text)>=0);
        if(groups[g]) n++;
      }
      tr.style.display=groups[g]?'':'none';
    }
    shown.textContent=n+' of '+table.getAttribute('data-groups')+' groups shown';
  }
  if(table){ q.addEventListener('input',apply); run.addEventListener('change',apply); step.addEventListener('change',apply); apply(); }
  // a record in the DOM that the figures were laid out with a size (read by the tests' DOM dump)
  var figs=document.querySelectorAll('figure.plot svg'), ok=0;
  for(var j=0;j<figs.length;j++){ var b=figs[j].getBoundingClientRect(); if(b.width>0&&b.height>0){ok++; figs[j].parentNode.setAttribute('data-rendered','1');} }
  document.body.setAttribute('data-plots-rendered', String(ok));
  var res=(window.performance&&performance.getEntriesByType)?performance.getEntriesByType('resource').length:-1;
  document.body.setAttribute('data-resource-requests', String(res));
})();
"""


def render_report(
    runs: list[RunLogs], extra: list[Section] | None = None, title: str | None = None
) -> str:
    """The whole page as a string: summary, alerts, extra sections, plots, config, samples."""
    sections = [summary_section(runs)] if runs else []
    alerts = alerts_section(runs)
    if alerts:
        sections.append(alerts)
    sections.extend(extra or [])
    if runs:  # a page of extra sections alone (e.g. `memory --budget -o`) has no run parts
        sections += [plots_section(runs), config_section(runs), samples_section(runs)]
    title = title or "peergrade report: " + ", ".join(r.name for r in runs)
    nav = "".join(
        f'<a href="#{s.anchor or f"s{i}"}">{html.escape(s.title)}</a>'
        for i, s in enumerate(sections)
    )
    body = "".join(
        f'<section id="{s.anchor or f"s{i}"}"><h2>{html.escape(s.title)}</h2>{s.html}</section>'
        for i, s in enumerate(sections)
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        f'<p class="muted">{len(runs)} run(s): '
        + ", ".join(html.escape(str(r.path)) for r in runs)
        + f"</p><nav>{nav}</nav>{body}<script>{SCRIPT}</script></body></html>\n"
    )


def write_report(
    paths: list[Path], out: Path, extra: list[Section] | None = None, title: str | None = None
) -> Path:
    """Read the run dirs in ``paths`` and write the report to ``out`` (atomically)."""
    paths = [Path(p) for p in paths]
    if not paths and not extra:
        raise InputError("report: give at least one run directory")
    names = unique_names(paths)
    runs = [load_run(p, n) for p, n in zip(paths, names)]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, render_report(runs, extra, title))
    return out
