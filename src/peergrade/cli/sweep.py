"""``peergrade sweep``: one run per value of a key, compared.

It parses and calls; the work happens in the library."""

from __future__ import annotations

from pathlib import Path

from peergrade.cli.common import (
    add_command,
    add_config,
    add_metric_args,
    add_output,
    add_overwrite,
    add_seed,
    overrides_of,
)
from peergrade.config import (
    load_config,
)


def run(args, extra) -> int:
    from peergrade.planning.sweep import parse_sets
    from peergrade.training import run_lock

    axes = parse_sets(args.set or [])
    base = overrides_of(args, extra)
    # one process writes a sweep directory (each variant's run directory is locked as well);
    # the default name is new: runs/sweep-<date>-<time>, -2, -3, ... when taken
    if args.output:
        lock = run_lock.acquire(Path(args.output), create=True)
    else:
        lock = run_lock.claim_new("runs/sweep-%Y%m%d-%H%M%S")
    with lock:
        return _sweep(args, axes, base, lock.directory)


def _sweep(args, axes, base, out_dir: Path) -> int:
    from peergrade.monitoring.report import load_run, write_report
    from peergrade.planning.sweep import (
        format_summary,
        run_sweep,
        summarize,
        sweep_section,
        variant_name,
    )

    def load(ov):
        run_dir = out_dir / variant_name(ov)
        return load_config(args.config, [*base, *ov, ("train.output_dir", str(run_dir))])

    from peergrade.training.trainer import train

    n = 1
    for _, values in axes:
        n *= len(values)
    print(f"sweep: {n} variant(s) of {' x '.join(k for k, _ in axes)} into {out_dir}", flush=True)
    results = run_sweep(
        load=load, axes=axes, out_dir=out_dir, train=train, overwrite=args.overwrite
    )
    runs = [load_run(out_dir / r["run_dir"]) for r in results]
    summary = summarize(runs, metric=args.metric, time_budget_s=args.time_budget)
    print(format_summary(summary))
    report = write_report(
        [out_dir / r["run_dir"] for r in results],
        out_dir / "report.html",
        [sweep_section(runs, summary)],
        title=f"peergrade sweep: {' x '.join(k for k, _ in axes)}",
    )
    print(f"report: {report}")
    return 130 if any(r["interrupted"] for r in results) else 0


def add_parser(sub) -> None:
    sw = add_command(
        sub,
        "sweep",
        run,
        "train a config once per value of one or more keys, compare, name the best",
        "Train the config once per value (several --set: every combination) with the "
        "same seed and steps, each into OUTPUT_DIR/<key=value>, then compare held-out accuracy "
        "against training time and completions generated, and the noise of the group-mean "
        "baseline per group size; writes OUTPUT_DIR/report.html and names the best variant. "
        "Other config keys can be given as --section.key value (they win over --steps/--seed).",
    )
    add_config(sw, ("steps", "train.steps"), ("seed", "train.seed"))
    sw.add_argument(
        "--set",
        action="append",
        metavar="KEY=V1,V2,...",
        help="a config key and the values to try, e.g. rollout.group_size=2,4,8,16; repeatable "
        "(the grid of all combinations)",
    )
    sw.add_argument("--steps", type=int, help="training steps of every variant (= --train.steps)")
    add_seed(sw, "seed of every variant (= --train.seed)")
    add_output(
        sw,
        "OUTPUT_DIR",
        "sweep directory (default: a new runs/sweep-<time>, with -2, -3, ... when taken); one "
        "process writes it at a time",
        "--output-dir",
    )
    add_overwrite(sw, "variant run dir")
    add_metric_args(
        sw,
        "held-out metric to compare (pass@1_sampled, pass@1_greedy, pass@K; default "
        "pass@1_sampled)",
        "name the best accuracy reached within this much training time (default: at the end)",
    )
