"""``peergrade export``: a run's checkpoint as a standalone Hugging Face directory.

It parses and calls; the work happens in the library."""

from __future__ import annotations

from peergrade.cli.common import add_command


def run(args, extra) -> int:
    from peergrade.training.export import export_checkpoint

    export_checkpoint(args.src, args.out, merge_lora=args.merge_lora)
    return 0


def add_parser(sub) -> None:
    x = add_command(
        sub,
        "export",
        run,
        "write a checkpoint as a standalone Hugging Face model directory",
        "Write a checkpoint (a run dir means its latest checkpoints/step-N) as a "
        "directory that plain AutoModelForCausalLM + AutoTokenizer load (vLLM, lm-eval and TRL "
        "load through them). A LoRA checkpoint is written as an adapter that peft's "
        "AutoPeftModelForCausalLM loads, or with --merge-lora as a merged full model. "
        "Training state (optimizer, RNG) is left out.",
    )
    x.add_argument("src", metavar="RUN_OR_CKPT", help="a run directory or a checkpoint directory")
    x.add_argument("out", metavar="OUT", help="output directory (must not exist or be empty)")
    x.add_argument(
        "--merge-lora",
        action="store_true",
        help="LoRA checkpoints: merge the adapter into the base weights, write a full model",
    )
