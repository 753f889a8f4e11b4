"""``peergrade sft``: the supervised warm-up (how the bundled models are made).

It parses and calls; the work happens in the library."""

from __future__ import annotations

from peergrade.cli.common import (
    add_command,
    add_output,
    add_overwrite,
    add_seed,
    add_task,
    key_value,
)


def run(args, extra) -> int:
    from peergrade.training.sft import SFTSettings, run_sft

    settings = SFTSettings(
        task=args.task,
        task_options=dict(key_value(o) for o in args.task_option),
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        threads=args.threads,
        tool_fraction=args.tool_fraction,
        tools=args.tools,
        data=args.data,
        chat_template=args.chat_template,
    )
    run_sft(
        out=args.output,
        init=args.init,
        model=args.model,
        settings=settings,
        overwrite=args.overwrite,
    )
    return 0


def add_parser(sub) -> None:
    s = add_command(
        sub,
        "sft",
        run,
        "supervised warm-up on a task (how the bundled model is made)",
        "Supervised fine-tuning on a task's prompt -> answer pairs. "
        "The bundled demo model is made with the command in docs/getting-started.md.",
    )
    add_output(s, "MODEL_DIR", "output model dir", "--out", required=True)
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--init", metavar="ARCH", help="start from a fresh tiny model: qwen2 | llama")
    src.add_argument("--model", help="start from an existing model dir")
    add_task(s, "built-in task whose answers are taught")
    s.add_argument("--steps", type=int, default=300, help="optimizer steps")
    s.add_argument("--batch-size", type=int, default=64, help="examples per step")
    s.add_argument("--lr", type=float, default=3e-3, help="learning rate (AdamW)")
    add_seed(s, default=0)
    s.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    s.add_argument(
        "--tool-fraction",
        type=float,
        default=0.0,
        help="share of examples taught as calculator episodes (call, result, answer; "
        "arithmetic only): how the calculator demo's model is made",
    )
    s.add_argument(
        "--tools",
        action="append",
        default=[],
        metavar="FILE:fn",
        help="warm up on your own tools ('path/to/file.py:fn' or 'module:fn', as env.tools; "
        "repeatable): every example is an episode that calls one with a well-formed call, "
        "reads its real result and answers (docs/environments.md, 'Your tools on your model')",
    )
    s.add_argument(
        "--data",
        metavar="FILE",
        help="with --tools: rows with 'prompt', 'call' ({'name', 'arguments'}) and an optional "
        "'answer' (default: prompts written from the tools' schemas and docstrings)",
    )
    s.add_argument(
        "--chat-template",
        metavar="FILE|NAME",
        help="a chat template instead of the model's own (a Jinja file or hermes | llama3; "
        "model.chat_template), used for the warm-up and saved with the output model",
    )
    add_overwrite(s, "output model dir")
