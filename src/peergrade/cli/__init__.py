"""The ``peergrade`` command line: parse arguments, call the library, print errors plainly.

  peergrade train [--config X.yaml] [--KEY.PATH VALUE ...]   GRPO training (no arguments: the CPU demo)
  peergrade eval --model DIR --task arithmetic --n 500 --k 8  held-out pass@1 / pass@k
  peergrade sft ...                                           supervised warm-up (builds the demo model)
  peergrade doctor --model DIR --tools FILE.py:fn             before training: can the model call the tools?
  peergrade convert MODEL.gguf OUT_DIR [--dtype bfloat16]     GGUF file -> Hugging Face model dir
  peergrade export RUN_OR_CKPT OUT [--merge-lora]             checkpoint -> standalone HF model dir
  peergrade serve --model M [--port 8000]                     the policy as an OpenAI-compatible endpoint
  peergrade config [--config X.yaml] [--KEY.PATH VALUE ...]   print the resolved config as YAML
  peergrade memory [--config X.yaml] [--lora] [--estimate-only]  peak memory: GRPO vs PPO, measured vs estimated
  peergrade memory --model configs/models/qwen2.5-7b --budget 24GiB   GRPO / PPO / GRPO+LoRA: which fits
  peergrade report RUN_DIR [RUN_DIR ...] [-o report.html]     one self-contained HTML report (overlaid)
  peergrade sweep --set rollout.group_size=2,4,8 [--steps N]  train each value, compare, name the best
  peergrade audit [--config X.yaml] [--reward R] [--samples RUN_DIR]  attack the reward functions
  peergrade launch --nproc-per-node 8 train --config X.yaml   torchrun with clean stops (exit 143 / 130)

Every config key can be overridden with ``--section.key value`` (the value is parsed as YAML).
A command's shortcuts (``train --steps N`` = ``--train.steps N``) are its own (``memory
--steps`` counts measured steps and sets no config key), and an explicit ``--section.key``
always wins over a shortcut. ``-o/--output PATH`` is always what the command writes: a run
directory (train), a sweep directory (sweep), a model directory (sft), an HTML file (report,
memory --budget); ``--output-dir`` and sft's ``--out`` still work.

Errors a user can fix (bad config, bad data, missing model files, a run dir that would be
overwritten) are ``peergrade.errors`` exceptions, printed by ``errors.report`` as one line
``error: ...`` with exit status 2; nothing else is done.

Each command is a module of its own (``cli/train.py``, ``cli/evaluate.py``, ...) with an
``add_parser(sub)`` built from the shared flag helpers of ``cli/common.py`` and a ``run(args,
extra)``. This package only parses and calls; the work happens in the library.
"""

from __future__ import annotations

import argparse
import sys

from peergrade import __version__
from peergrade.cli import (
    audit,
    config,
    convert,
    doctor,
    evaluate,
    export,
    launch,
    memory,
    report,
    serve,
    sft,
    sweep,
    train,
)
from peergrade.cli.common import EXAMPLES, split_overrides  # noqa: F401 - docgen and tests read them here
from peergrade.errors import InputError, PeergradeError, out_of_memory
from peergrade.errors import report as report_error  # cli.report is the command

UserError = InputError  # the old name of a command-line user error (one family: peergrade.errors)

#: the commands, in the order ``peergrade --help`` lists them (each module: add_parser, run)
COMMANDS = (
    train,
    config,
    evaluate,
    sft,
    doctor,
    memory,
    report,
    sweep,
    audit,
    convert,
    export,
    serve,
    launch,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="peergrade",
        description="GRPO training for language models. Run `peergrade train` for the CPU demo.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"peergrade {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    console = argv is None  # the command itself, not a caller in Python (tests, a script)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"] and not {"-h", "--help"} & set(launch.split_help(argv[1:])):
        args, extra = parser.parse_args(["launch"]), argv[1:]  # torchrun's options, verbatim
    else:
        args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from peergrade.monitoring.metrics import quiet_hf_progress

    try:
        if extra and not args.overrides:
            raise InputError(f"unexpected arguments for {args.command}: {' '.join(extra)}")
        with quiet_hf_progress():  # the same policy as trainer.train's from Python
            return _stopped_quietly(args.func(args, extra), console)
    except PeergradeError as e:
        # Bad config, data, model dir, reward or run dir: the message names what is wrong.
        return report_error(e)
    except KeyboardInterrupt:
        # Ctrl-C outside the training loop (loading, evaluation): nothing to save yet.
        print("interrupted", file=sys.stderr)
        return _stopped_quietly(130, console)
    except (MemoryError, ImportError) as e:
        # a bare MemoryError prints nothing useful, and under `ulimit -v` torch's own import
        # fails with "failed to map segment": either way, one line with the cause
        if isinstance(e, ImportError) and "failed to map segment" not in str(e):
            raise
        print(f"error: {out_of_memory(e)}", file=sys.stderr)
        return 1


def _stopped_quietly(code: int, console: bool) -> int:
    """After a stop (130 Ctrl-C, 143 SIGTERM) the command is on its way out (worker processes
    joined, files closed): a further Ctrl-C then exits at once with the same status, instead
    of dying by the signal (status -2) with a traceback from wherever the exit was. Only for
    the command itself: a Python caller of ``main`` keeps its own SIGINT handling."""
    if console and code in (130, 143):
        import os
        import signal

        signal.signal(signal.SIGINT, lambda signum, frame: os._exit(code))
    return code


if __name__ == "__main__":
    sys.exit(main())
