"""``peergrade report``: one self-contained HTML report of one or more runs.

It parses and calls; the work happens in the library."""

from __future__ import annotations

from pathlib import Path

from peergrade.cli.common import add_command, add_metric_args, add_output
from peergrade.config import (
    load_run_config,
)


def run(args, extra) -> int:
    from peergrade.monitoring.report import is_run_dir, load_run, unique_names, write_report
    from peergrade.planning.sweep import format_summary, read_sweep, summarize, sweep_section

    paths, sections = [], []
    for p in map(Path, args.run_dirs):
        if (p / "sweep.json").exists() and not is_run_dir(p):
            runs, _info = read_sweep(p)
            loaded = [load_run(d, n) for d, n in zip(runs, unique_names(runs))]
            summary = summarize(loaded, metric=args.metric, time_budget_s=args.time_budget)
            print(format_summary(summary))
            sections.append(sweep_section(loaded, summary))
            paths.extend(runs)
        else:
            paths.append(p)
    if args.budget:
        sections.append(_run_memory_section(paths[0], args.budget))
    out = Path(args.output or (Path(args.run_dirs[0]) / "report.html"))
    write_report(paths, out, sections)
    print(f"wrote {out}")
    return 0


def _run_memory_section(run_dir: Path, budget_text: str):
    """The memory estimate of a run's own config (GRPO / PPO / GRPO+LoRA) against a budget."""
    import html

    from peergrade.monitoring.report import Section, memory_chart
    from peergrade.planning.budget import budget_rows, format_budget, parse_size

    budget = parse_size(budget_text)
    cfg = load_run_config(str(run_dir / "config.yaml"))
    rows, _ = budget_rows(cfg, device="cuda")
    svg = memory_chart(rows, budget)
    body = (
        f"<p>{html.escape(str(run_dir))}'s config on a {html.escape(budget_text)} device (bfloat16 "
        f"unless the config says otherwise)</p><pre>{html.escape(format_budget(rows, budget))}</pre>"
        f'<div class="grid"><figure class="plot" data-panel="memory">{svg}</figure></div>'
    )
    return Section("Memory budget", body, "memory")


def add_parser(sub) -> None:
    rp = add_command(
        sub,
        "report",
        run,
        "one self-contained HTML report of one or more runs (plots, config, completions)",
        "Write one HTML file (no network needed to open it) with the training curves "
        "(reward per function, held-out accuracy, KL, entropy, length, zero-signal fraction, "
        "clipping, tokens/s, time per phase), the resolved config and a searchable table of the "
        "sampled groups. Several run dirs are overlaid; a sweep dir adds the sweep comparison. "
        "Works on a run that is still going or was killed.",
    )
    rp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run (or sweep) directories")
    add_output(rp, "FILE", "output file (default RUN_DIR/report.html)")
    add_metric_args(
        rp,
        "held-out metric the sweep section compares (default pass@1_sampled)",
        "sweep section: the best accuracy reached within this much training time",
    )
    rp.add_argument(
        "--budget",
        metavar="SIZE",
        help="add the memory estimate of the first run's config against this budget (e.g. 24GiB)",
    )
