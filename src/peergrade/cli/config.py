"""``peergrade config``: the resolved config as YAML (or the key reference as Markdown).

It parses and calls; the work happens in the library."""

from __future__ import annotations

import sys

from peergrade.cli.common import add_command, add_config, config_from
from peergrade.config import (
    to_markdown,
    to_yaml,
)


def run(args, extra) -> int:
    cfg = config_from(args, extra)
    if args.markdown:
        sys.stdout.write(to_markdown(cfg))
    else:
        sys.stdout.write(to_yaml(cfg, comments=not args.no_comments))
    return 0


def add_parser(sub) -> None:
    c = add_command(
        sub,
        "config",
        run,
        "print the resolved config as commented YAML",
        "Print the full resolved config (defaults <- --config <- overrides).",
    )
    add_config(c)
    c.add_argument(
        "--markdown", action="store_true", help="print the config reference as a Markdown table"
    )
    c.add_argument(
        "--no-comments", action="store_true", help="YAML without the documentation comments"
    )
