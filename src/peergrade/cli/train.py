"""``peergrade train``: GRPO (or PPO) training; no arguments: the CPU demo.

It parses and calls; the work happens in the library."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from peergrade.cli.common import (
    EXAMPLES,
    add_command,
    add_config,
    add_output,
    add_overwrite,
    add_policy_model,
    add_seed,
    config_from,
)
from peergrade.errors import InputError


def run(args, extra) -> int:
    from peergrade.training import checkpoint as ckpt

    # the trainer takes the run directory (making runs/<date>-<time> when none is given) and
    # holds its lock; the checks here only make the errors come before any config is read
    if args.resume:
        run_dir = Path(args.resume)
        # leftovers are swept by the trainer, under the run's lock
        ckpt.check_run_dir(run_dir, resume=True, overwrite=False, sweep=False)
        if args.config:
            raise InputError(
                "--resume uses the run's own config.yaml; do not pass --config with it"
            )
        args.config = str(run_dir / "config.yaml")
        cfg = config_from(args, extra, run_config=True)
    else:
        cfg = config_from(args, extra)
        run_dir = Path(cfg.train.output_dir) if cfg.train.output_dir else None
        if run_dir is not None:
            ckpt.check_run_dir(run_dir, resume=False, overwrite=args.overwrite)
    held = [run_dir]  # the directory the trainer took (a new runs/<date>-<time>)
    # under torchrun: a failure names its rank, and the process group is torn down either way;
    # a SIGTERM while the trainer imports or loads is a stop, as a Ctrl-C there
    try:
        with ckpt.sigterm_stops():
            from peergrade.distributed import main_guard
            from peergrade.planning.memory import resolve_checkpointing
            from peergrade.training.trainer import train

            resolve_checkpointing(cfg)  # model.gradient_checkpointing auto, before the model
            summary = main_guard(
                train,
                cfg,
                run_dir,
                resume=bool(args.resume),
                overwrite=args.overwrite,
                on_run_dir=lambda path: held.__setitem__(0, path),
            )
    except KeyboardInterrupt as stop:
        # while loading or evaluating the starting model: the run directory may already exist
        code, what = (143, "SIGTERM") if isinstance(stop, ckpt.Terminated) else (130, "interrupted")
        run_dir = held[0]
        if run_dir is not None and (run_dir / "config.yaml").is_file():
            last = ckpt.latest_checkpoint(run_dir)
            print(
                f"{what} before the first checkpoint: continue with: peergrade train "
                f"--resume {run_dir} (starts from step 0), or start over with --overwrite"
                if last is None
                else f"{what} before training went on: {last.name} is the last checkpoint; "
                f"continue with: peergrade train --resume {run_dir}",
                file=sys.stderr,
            )
            return code
        print(f"{what} before the run started: no checkpoint was written", file=sys.stderr)
        return code
    if summary.get("interrupted"):
        return 143 if summary.get("signal") == "SIGTERM" else 130
    return 0


def add_parser(sub) -> None:
    t = add_command(
        sub,
        "train",
        run,
        "GRPO training (no arguments: the CPU demo)",
        "GRPO training. With no arguments: the CPU demo (bundled tiny model, arithmetic task), "
        "ending with a before/after held-out accuracy table. Any config key can be overridden "
        "with --section.key value (see `peergrade config`); it wins over the shortcuts below.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config(
        t,
        ("model", "model.path"),
        ("data", "data.path"),
        ("reward", "rewards"),
        ("tools", "env.tools"),
        ("env", "env.factory"),
        ("harness", "harness.fn"),
        ("steps", "train.steps"),
        ("seed", "train.seed"),
        ("output", "train.output_dir"),
    )
    t.add_argument(
        "--trl-config",
        metavar="RECIPE",
        help="a TRL GRPOConfig / open-r1 recipe YAML (see docs/coming-from-trl.md); "
        "--section.key overrides still apply after it",
    )
    add_policy_model(t)
    t.add_argument("--data", help="user dataset file (= --data.path)")
    t.add_argument(
        "--reward",
        action="append",
        metavar="SPEC",
        help="reward: built-in name, module:fn, file.py:fn or a reward-model dir "
        "(AutoModelForSequenceClassification), optionally =WEIGHT; repeatable (= rewards)",
    )
    t.add_argument(
        "--tools",
        action="append",
        metavar="FILE.py:fn",
        help="a tool the model may call (TRL's tools: type hints and a docstring), file.py:fn "
        "or module:fn; repeatable: each completion becomes a multi-turn episode (= env.tools)",
    )
    t.add_argument(
        "--env",
        metavar="FILE.py:Class",
        help="an environment class: TRL's environment_factory or a native reset/step "
        "environment, or verifiers:MODULE, a verifiers environment (= env.factory; see "
        "docs/environments.md)",
    )
    t.add_argument(
        "--harness",
        metavar="FILE.py:fn",
        help="an external agent, fn(row, base_url, model) -> reward: each completion is an "
        "episode it runs against the policy served as an OpenAI-compatible endpoint; what it "
        "returns is the reward and scores the held-out episodes (= harness.fn; see "
        "docs/serving.md)",
    )
    t.add_argument("--steps", type=int, help="training steps (= --train.steps)")
    add_seed(t, "random seed (= --train.seed)")
    add_output(
        t,
        "RUN_DIR",
        "run directory (= --train.output_dir; default: a new runs/<date>-<time>, with -2, -3, "
        "... when taken); one process writes a run directory at a time: a second writer is "
        "refused with the first one's pid",
        "--output-dir",
    )
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    add_overwrite(t, "run directory")
