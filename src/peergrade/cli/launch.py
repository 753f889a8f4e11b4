"""``peergrade launch``: ``torchrun`` for a peergrade command, with clean stops.

  peergrade launch --nproc-per-node 8 train --config my.yaml
  peergrade launch --nnodes 4 --node-rank $NODE --nproc-per-node 8 \\
      --master-addr HOST --master-port 29500 train --config my.yaml

Everything before the command is PyTorch's launcher's own options (``torchrun --help``);
the command and what follows it are the peergrade command each rank runs (``-m peergrade``).
It is PyTorch's launcher itself (``torch.distributed.run``), called in-process, with two
differences at the end of a run:

- a SIGTERM (Kubernetes, Slurm preemption, ``docker stop``) or Ctrl-C on the launcher is
  passed to the ranks as torchrun does (each saves after its step and stops; rank 0 prints the
  one line with the resume command), and the launcher exits 143 / 130 without a traceback;
  plain ``torchrun`` ends the same stop with exit 1 and its own 30-line traceback;
- ranks that stopped on a signal are not reported as failures; a rank that failed is reported
  in PyTorch's summary (no traceback of the launcher's own frames) with exit 1.
"""

from __future__ import annotations

import logging
import signal
import sys

from peergrade.cli.common import add_command
from peergrade.errors import InputError

#: the commands a rank may run under the launcher (training is what scales out)
RANK_COMMANDS = ("train",)

DESCRIPTION = (
    "torchrun for a peergrade command: PyTorch's launcher (torch.distributed.run) called "
    "in-process with the same options before the command, which each rank runs as -m peergrade. "
    "A SIGTERM (preemption, docker stop) or Ctrl-C reaches the ranks as with torchrun: each "
    "saves after its step and stops, rank 0 prints the one line with the resume command, and "
    "the launcher exits 143 / 130 without a traceback (plain torchrun: exit 1 and its own "
    "traceback). A rank that fails is reported in PyTorch's summary, exit 1."
)

EPILOG = """examples:
  peergrade launch --nproc-per-node 8 train --config my.yaml
  peergrade launch --nnodes 4 --node-rank $NODE --nproc-per-node 8 \\
      --master-addr HOST --master-port 29500 train --config my.yaml
  peergrade launch --nproc-per-node 8 train --resume runs/X"""


def add_parser(sub) -> None:
    import argparse

    p = add_command(
        sub,
        "launch",
        run,
        "torchrun for a peergrade command, with clean stops (exit 143 / 130)",
        DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="peergrade launch [TORCHRUN OPTIONS] train [ARGS ...]",
    )
    p.set_defaults(overrides=True)  # the launcher's and the command's flags are passed through


def split_help(argv: list[str]) -> list[str]:
    """The launcher's own options of ``argv`` (all of it when no command is named yet)."""
    return next((argv[:i] for i, a in enumerate(argv) if a in RANK_COMMANDS), argv)


def split(argv: list[str]) -> tuple[list[str], list[str]]:
    """``[launcher options] COMMAND [args]`` -> (launcher options, [COMMAND, args...])."""
    for i, a in enumerate(argv):
        if a in RANK_COMMANDS:
            return argv[:i], argv[i:]
    raise InputError(
        "peergrade launch: name the command each rank runs after the launcher's options, "
        "e.g. peergrade launch --nproc-per-node 2 train --config my.yaml "
        f"(commands: {', '.join(RANK_COMMANDS)})"
    )


def run(args, extra) -> int:
    return launch(extra)


def launch(argv: list[str]) -> int:
    """Run ``torch.distributed.run`` with ``argv`` (launcher options, then the command)."""
    launcher, command = split(argv)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torch_run

    targs = parse_args([*launcher, "-m", "peergrade", *command])
    # its "Received 15 death signal" / "Sending process closing signal" warnings are the
    # launcher's side of a stop the ranks report themselves
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.ERROR)
    try:
        torch_run(targs)
    except SignalException as e:
        return _stopped(int(e.sigval), targs.node_rank)
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        if codes <= {130, 143, -signal.SIGINT, -signal.SIGTERM}:  # stopped on a signal
            return 143 if codes & {143, -signal.SIGTERM} else 130
        print(e.format_msg(), file=sys.stderr)
        return 1
    return 0


def _stopped(signum: int, node_rank: int) -> int:
    """The launcher got ``signum``: the ranks were told and have ended."""
    name = signal.Signals(signum).name
    if node_rank != 0:  # node 0's rank 0 printed the checkpoint and the resume command
        print(
            f"{name}: this node's ranks stopped; node 0's output names the checkpoint and the "
            "resume command",
            file=sys.stderr,
        )
    return 130 if signum == signal.SIGINT else 128 + signum
