"""Benchmark: how long ``peergrade audit``'s battery takes, per reward mix, on one core.

Prints, for each mix, the wall time of ``audit_rewards`` on the first N rows of its task (torch
and the reward modules imported beforehand, as in ``peergrade train``, where the start-up
audit runs after they are loaded) and the number of completions scored; then, with --code,
the battery of the ``code_tests`` reward on small assert and stdin/stdout rows, in sandboxed
programs per second.

    OMP_NUM_THREADS=1 python bench/audit.py [--rows 100] [--code] [--repeat 3]

The target is under 10 s for 100 rows and 3 reward functions (no code).
"""

from __future__ import annotations

import argparse
import itertools
import time

from _common import load_note, median
from peergrade.rewards import audit, make_reward_specs
from peergrade.rewards.math import clear_caches
from peergrade.tasks import load_task

MIXES = {
    "arithmetic + format + repetition_penalty": [
        ("arithmetic", 1.0, {}, None),
        ("format", 0.2, {"mode": "answer_only"}, None),
        ("repetition_penalty", 0.1, {}, None),
    ],
    "arithmetic + format + math_accuracy": [
        ("arithmetic", 1.0, {}, None),
        ("format", 0.2, {"mode": "answer_only"}, None),
        ("math_accuracy", 1.0, {}, None),
    ],
}

CODE_ROWS = [
    {
        "prompt": f"Write add{i}(a, b), the sum.",
        "tests": [f"assert add{i}(1, 2) == 3", f"assert add{i}(2, 5) == 7"],
        "canonical_solution": f"def add{i}(a, b):\n    return a + b\n",
    }
    for i in range(4)
] + [
    {
        "prompt": f"Read n and print n + {i}.",
        "tests": [{"input": "3\n", "output": str(3 + i)}, {"input": "5\n", "output": str(5 + i)}],
        "solution": f"print(int(input()) + {i})",
    }
    for i in range(4)
]


def count_completions(report) -> int:
    """Completions the battery scored per function (the exploits' and probes' rows)."""
    return sum(f.rows for f in report.units[0].findings)


def startup(repeat: int) -> None:
    """What ``train.audit_rewards: warn`` adds to ``peergrade train`` (the demo's config)."""
    t0 = time.perf_counter()
    from peergrade.config import load_config
    from peergrade.training.trainer import build_rewards, build_task

    cfg = load_config(None)
    task = build_task(cfg)
    rewards = build_rewards(cfg, task)
    print(f"imports and config: {time.perf_counter() - t0:.2f} s (paid by training anyway)")
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        report = audit.at_startup(cfg, task, rewards)
        times.append(time.perf_counter() - t0)
    print(
        f"start-up audit of the demo ({[s.name for s in rewards]}, {audit.STARTUP_ROWS} rows): "
        f"median {median(times):.3f} s of {repeat}, lines printed: {len(report.lines())}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--code", action="store_true", help="also the code_tests battery")
    ap.add_argument(
        "--startup",
        action="store_true",
        help="also the demo's start-up audit (train.audit_rewards)",
    )
    args = ap.parse_args()
    print(load_note())
    if args.startup:
        startup(args.repeat)
    rows = list(itertools.islice(load_task("arithmetic").train_rows(0), args.rows))
    for label, items in MIXES.items():
        specs = make_reward_specs(items)
        audit.audit_rewards(specs, rows[:2])  # imports (torch, math-verify) outside the timing
        times = []
        for _ in range(args.repeat):
            clear_caches()  # each repeat is a first audit: math_accuracy's memo starts empty
            t0 = time.perf_counter()
            report = audit.audit_rewards(specs, rows)
            times.append(time.perf_counter() - t0)
        print(
            f"{label}: {args.rows} rows, median {median(times):.2f} s of {args.repeat} "
            f"(min {min(times):.2f}), failed={report.failed}"
        )
    if args.code:
        specs = make_reward_specs([("code_tests", 1.0, {"timeout_s": 1.0}, None)])
        t0 = time.perf_counter()
        report = audit.audit_rewards(specs, CODE_ROWS)
        wall = time.perf_counter() - t0
        programs = sum(f.rows for f in report.units[0].findings if f.kind in ("code", "format"))
        print(
            f"code_tests: {len(CODE_ROWS)} rows, {wall:.1f} s, about {programs} programs "
            f"(plus the references), failed={report.failed}"
        )


if __name__ == "__main__":
    main()
