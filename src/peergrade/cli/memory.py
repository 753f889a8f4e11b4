"""``peergrade memory``: peak memory estimated and measured; ``--budget``: what fits a device.

It parses and calls; the work happens in the library."""

from __future__ import annotations

import json
from pathlib import Path

from peergrade.cli.common import add_command, add_config, add_output, add_policy_model, config_from
from peergrade.errors import InputError


def run(args, extra) -> int:
    from peergrade.planning.memory import (
        estimate_for_config,
        format_estimates,
        format_table,
        measure_memory,
    )

    cfg = config_from(args, extra)
    if args.budget is not None:
        return _memory_budget(args, cfg)
    if args.output:
        raise InputError("memory -o/--output writes the budget chart: use it with --budget")
    variants = _variants(args, cfg)
    if args.world < 1:
        raise InputError(f"--world must be >= 1, got {args.world}")
    if args.estimate_only or args.world > 1:
        rows = [
            (label, estimate_for_config(c, prompt_len=args.prompt_len, world=args.world))
            for label, c in variants
        ]
        if args.json:
            print(
                json.dumps(
                    {
                        "world": args.world,
                        "variants": [{"label": label, "estimate": est} for label, est in rows],
                    }
                )
            )
            return 0
        _memory_header(cfg, args.world)
        if args.world > 1:
            print(f"per rank: {args.world} ranks, dist.strategy {cfg.dist.strategy}")
        print(format_estimates(rows))
        _print_run_peaks(rows)
        return 0
    if not args.json:
        _memory_header(cfg, 1)
    rows = []
    for label, c in variants:
        m = measure_memory(c, steps=args.steps, allocator=args.allocator)
        rows.append((label, m, estimate_for_config(c, prompt_len=m["prompt_len"])))
        if args.json:
            continue
        print(
            f"  measured {label}: {m['peak'] / 2**20:.0f} MiB above a baseline of "
            f"{m['baseline_bytes'] / 2**20:.0f} MiB",
            flush=True,
        )
        if not m["update_ran"]:
            print(
                f"  warning: {label}: no measured step ran its update (every minibatch had zero "
                "signal), so its peak is the generation's, not a training step's",
                flush=True,
            )
    if args.json:
        print(
            json.dumps(
                {
                    "world": 1,
                    "variants": [
                        {"label": label, "estimate": est, "measured": m} for label, m, est in rows
                    ],
                }
            )
        )
        return 0
    print(format_table(rows))
    _print_run_peaks([(label, est) for label, _, est in rows], [m for _, m, _ in rows])
    if cfg.rollout.async_steps:
        print(
            "note: rollout.async_steps >= 1: the measurement runs the synchronous step (no "
            "producer); the estimate adds the producer's weight copies and its generation "
            "beside the update (docs/async.md)"
        )
    unit = "CUDA max allocated" if rows[0][1]["device"] == "cuda" else "peak RSS"
    print(
        f"(MiB; measured = {unit} above the process baseline, max over {args.steps} steps, "
        "every completion run to max_completion_length and given a distinct reward so that the "
        "update trains every row; error = (estimated - measured) / measured)"
    )
    return 0


def _variants(args, cfg) -> list:
    """``(label, config)`` per ``--algos`` algorithm, with and without LoRA under ``--lora``."""
    import copy

    from peergrade.config import validate

    variants = []
    algos = args.algos.split(",")
    teacher = cfg.algo.teacher_path is not None or cfg.algo.teacher_url is not None
    for algo in algos:
        if algo not in ("grpo", "ppo"):
            raise InputError(f"--algos: {algo!r} is not an algorithm; choose grpo and/or ppo")
        if algo == "ppo" and teacher and len(algos) > 1:
            continue  # on-policy distillation is a GRPO mode: its teacher is counted with grpo
        loras = [cfg.model.lora.enabled, not cfg.model.lora.enabled] if args.lora else [None]
        for lora in loras:
            c = copy.deepcopy(cfg)
            c.algo.name = algo
            if lora is not None:
                c.model.lora.enabled = lora
            validate(c)
            variants.append((algo + ("-lora" if c.model.lora.enabled else ""), c))
    return variants


def _memory_header(cfg, world: int) -> None:
    from peergrade.training.components import eval_batch_line

    print(
        f"model: {cfg.model.path}   batch: {cfg.rollout.prompts_per_step} x "
        f"{cfg.rollout.group_size}   completion: {cfg.rollout.max_completion_length} tokens   "
        f"beta: {cfg.algo.beta}"
    )
    if cfg.algo.teacher_path is not None:
        print(f"teacher (on-policy distillation, resident all run): {cfg.algo.teacher_path}")
    elif cfg.algo.teacher_url is not None:
        print(f"teacher behind {cfg.algo.teacher_url}: no weights here, the student's pass only")
    print(eval_batch_line(cfg, world))


def _print_run_peaks(rows, measured=None) -> None:
    """One line per variant: the run's estimated peak (every phase, held-out evaluation and
    checkpoint save included), the phase that sets it, and the training step's peak; with a measurement, the
    whole process's (its baseline added: compare with a run's peak RSS)."""
    for i, (label, est) in enumerate(rows):
        evaluate = est["phases"].get("evaluate")
        base = measured[i]["baseline_bytes"] if measured else None
        print(
            f"estimated run peak {label}: {est['peak'] / 2**20:.0f} MiB, set by "
            f"{est['peak_phase']} (training step {est['step_peak'] / 2**20:.0f} MiB"
            + (f", held-out evaluation {evaluate / 2**20:.0f} MiB" if evaluate else "")
            + f", checkpoint save {est['phases']['checkpoint'] / 2**20:.0f} MiB"
            + "; above the process baseline)"
            + (
                f"; with the measured baseline, the whole process: "
                f"{(est['peak'] + base) / 2**20:.0f} MiB"
                if base is not None
                else ""
            )
        )


def _memory_budget(args, cfg) -> int:
    """``memory --budget``: the estimate of GRPO, PPO and GRPO+LoRA against the budget."""
    import copy

    from peergrade.planning.budget import (
        VARIANTS,
        budget_rows,
        fit_search,
        format_budget,
        format_fits,
        parse_size,
    )

    budget = parse_size(args.budget)
    device = args.device
    rows, prompt_len = budget_rows(cfg, device=device, prompt_len=args.prompt_len)
    dtype = (
        cfg.model.dtype
        if cfg.model.dtype != "auto"
        else ("bfloat16" if device == "cuda" else "float32")
    )
    r = cfg.rollout
    head = (
        f"model: {cfg.model.path}   device: {device} ({dtype})   batch: {r.prompts_per_step} x "
        f"{r.group_size}   prompt: {prompt_len} + completion: {r.max_completion_length} tokens   "
        f"micro-batch: {cfg.optim.micro_batch_size}   beta: {cfg.algo.beta}   "
        f"LoRA r: {cfg.model.lora.r}"
    )
    print(head)
    print(f"budget: {budget / 2**30:.2f} GiB")
    table = format_budget(rows, budget)
    print(table)
    fits = []
    for (label, algo, lora), (_, est) in zip(VARIANTS, rows):
        c = copy.deepcopy(cfg)
        c.algo.name, c.model.lora.enabled = algo, lora
        fit = None
        if est["peak"] > budget:
            fit = fit_search(c, budget, device=device, prompt_len=prompt_len, lora=lora)
        fits.append((label, est["peak"], fit))
    advice = format_fits(fits, budget)
    print(advice)
    table += "\n\n" + advice
    if args.output:
        import html

        from peergrade.monitoring.report import Section, memory_chart, write_report

        svg = memory_chart(
            rows, budget, title=f"{Path(str(cfg.model.path)).name}: estimated peak per phase"
        )
        body = (
            f"<p>{html.escape(head)}</p><pre>{html.escape(table)}</pre>"
            f'<div class="grid"><figure class="plot" data-panel="memory">{svg}</figure></div>'
        )
        out = write_report(
            [],
            Path(args.output),
            [Section("Memory budget", body, "memory")],
            title=f"peergrade memory: {cfg.model.path} in {args.budget}",
        )
        print(f"wrote {out}")
    return 0


def add_parser(sub) -> None:
    mm = add_command(
        sub,
        "memory",
        run,
        "measured and estimated peak memory of a config (GRPO vs PPO, LoRA)",
        "Run two training steps of the config per algorithm in a child process and print the "
        "measured peak (CUDA max allocated, or peak RSS on CPU) next to the estimate from the "
        "model config (weights, grads, optimizer, reference, critic, activations). Config keys "
        "are set with --section.key value (--steps is the number of measured steps, not "
        "train.steps).",
    )
    add_config(mm, ("model", "model.path"))
    add_policy_model(mm)
    mm.add_argument("--algos", default="grpo,ppo", help="comma-separated: grpo,ppo (default both)")
    mm.add_argument("--lora", action="store_true", help="also the other LoRA setting")
    mm.add_argument(
        "--steps", type=int, default=2, help="measured steps (default 2; not train.steps)"
    )
    mm.add_argument("--estimate-only", action="store_true", help="no measurement: the estimate")
    mm.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: per variant the estimate (phases, peak, peak_phase, "
        "step_peak, eval_batch) and, when measured, the measurement",
    )
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
    mm.add_argument(
        "--budget",
        metavar="SIZE",
        help="device memory, e.g. 24GiB or 80GB: estimate GRPO, PPO and GRPO+LoRA of the config "
        "(no measurement) and say which fits, per phase; --model may be a folder holding just "
        "a config.json (configs/models/qwen2.5-7b)",
    )
    mm.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="with --budget: the device the estimate is for (default cuda: bfloat16 weights, "
        "gradient checkpointing unless the config says otherwise)",
    )
    add_output(mm, "FILE", "with --budget: also write an HTML page with a bar chart")
