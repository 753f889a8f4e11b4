"""``peergrade audit``: the reward functions (and judges) attacked before training; a run's suspects.

It parses and calls; the work happens in the library."""

from __future__ import annotations

import argparse
import json
import sys

from peergrade.cli.common import add_command, add_config, config_from
from peergrade.errors import InputError

AUDIT_MAX_ROWS = 10_000  # peergrade audit --rows on a task without an end (generated rows)


def run(args, extra) -> int:
    """Attack the configured reward functions with known exploits (docs/audit.md)."""
    from peergrade.rewards import audit

    if not 0 < args.fail_share <= 1 or args.rows < 1 or args.judge_rows < 1:
        raise InputError("--fail-share must be in (0, 1], --rows and --judge-rows at least 1")
    if args.samples:
        if extra:
            raise InputError(f"--samples reads a run; unexpected arguments: {' '.join(extra)}")
        found = audit.samples_audit(args.samples, top=args.top)
        print(json.dumps(found) if args.json else audit.format_samples(found))
        return 1 if found["suspects"] else 0
    from peergrade.training.components import build_rewards, build_task

    cfg = config_from(args, extra)
    task = build_task(cfg)
    rows = args.rows
    size = len(task) if hasattr(task, "__len__") else None
    if size and rows > size:  # the stream repeats the data (epochs): more rows add nothing
        print(
            f"audit: --rows {rows} is more than the data's {size} training rows: "
            f"auditing those {size}",
            file=sys.stderr,
        )
        rows = size
    elif rows > AUDIT_MAX_ROWS:  # a generated task has no end
        print(f"audit: --rows {rows} capped at {AUDIT_MAX_ROWS}", file=sys.stderr)
        rows = AUDIT_MAX_ROWS
    specs = build_rewards(cfg, task)
    # a judge is audited for its own biases (rewards/judge_audit.py), not with the exploit battery
    from peergrade.rewards.judge_audit import audit_judge, judge_of

    judges = [(s, judge_of(s)) for s in specs]
    judged = any(j is not None for _, j in judges)
    judge_rows = audit.first_rows(task, args.judge_rows, cfg.train.seed) if judged else []
    judge_reports = [  # groups of the run's size, as the judge sees them in training
        audit_judge(j, judge_rows, name=s.name, answers=cfg.rollout.group_size)
        for s, j in judges
        if j is not None
    ]
    specs = [s for s, j in judges if j is None]
    report = None
    if specs:
        report = audit.audit_rewards(
            specs,
            audit.first_rows(task, rows, cfg.train.seed),
            fail_share=args.fail_share,
            max_steps=cfg.train.steps,
        )
    if args.json:
        out = report.to_dict() if report is not None else {}
        if judge_reports:
            out["judges"] = [r.to_dict() for r in judge_reports]
        print(json.dumps(out))
    else:
        texts = [report.format(verbose=args.all)] if report is not None else []
        print("\n\n".join(texts + [r.format() for r in judge_reports]))
    failed = (report is not None and report.failed) or any(r.failed for r in judge_reports)
    return 1 if failed else 0


def _whole_number(text: str) -> int:
    """An argparse type: a whole number, also written as 1e6."""
    try:
        value = float(text)
        if not value.is_integer():
            raise ValueError
        return int(value)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def add_parser(sub) -> None:
    au = add_command(
        sub,
        "audit",
        run,
        "attack the reward functions with the exploits models find (before training)",
        "Score a battery of adversarial completions (candidate lists, empty tags, "
        "code that exits before its tests, ...) built from the first rows, next to a correct "
        "and a wrong completion, with every reward function of the config. Exit status 1 when "
        "an exploit scores at least as well as the correct completion on --fail-share of the "
        "rows (see docs/audit.md). A judge reward is audited for its biases instead (position "
        "per slot, length, two injections and the rubric's keywords over same-length neutral "
        "controls, self-consistency, agreement with its gold pairs; exit 1 past a threshold) "
        "on groups of rollout.group_size answers. With --samples: the "
        "suspect completions of a finished run.",
    )
    add_config(au, ("reward", "rewards"), ("data", "data.path"), ("task", "data.task"))
    au.add_argument("--reward", action="append", metavar="SPEC", help="as for train; repeatable")
    au.add_argument("--data", help="user dataset file (= --data.path)")
    au.add_argument("--task", help="built-in task (= --data.task)")
    au.add_argument(
        "--rows",
        type=_whole_number,
        default=100,
        help="rows to attack (default 100; capped at the data's size)",
    )
    au.add_argument(
        "--fail-share",
        type=float,
        default=0.1,
        metavar="SHARE",
        help="an exploit that matches the correct completion on at least this share of the "
        "rows fails the audit (default 0.1)",
    )
    au.add_argument(
        "--judge-rows",
        type=int,
        default=20,
        help="rows a judge reward is audited on (position, length, injection, keyword, "
        "consistency; default 20; its gold pairs are asked too)",
    )
    au.add_argument("--all", action="store_true", help="also list the exploits that do not apply")
    au.add_argument("--json", action="store_true", help="print one JSON object")
    au.add_argument("--samples", metavar="RUN_DIR", help="re-examine a run's samples.jsonl instead")
    au.add_argument("--top", type=int, default=20, help="--samples: suspects shown (default 20)")
