"""Held-out evaluation: greedy pass@1, sampled pass@1 and pass@k.

Correctness is the task's *accuracy reward* (its first default reward, e.g. ``arithmetic``
for the arithmetic task) scoring 1.0. ``pass@k`` uses the unbiased estimator of Chen et al.
(2021), ``1 - C(n - c, k) / C(n, k)`` for n samples with c correct (here n == k).

The pass@k curve (``evaluate(..., curve=True)``, ``peergrade eval --curve``): from the same k
samples per problem, ``pass@j`` for every j = 1..k, each averaged over problems. It costs no
extra generation; ``pass@1`` equals ``pass@1_sampled`` and ``pass@k`` is the usual key. The
gap between pass@k and pass@1 is the headroom GRPO can turn into pass@1 (docs/recipes.md).

``peergrade eval --few-shot N`` puts N solved example turns before every held-out prompt (the
training curriculum's examples, ``peergrade.tasks.curriculum.FewShot``, drawn from training
problems only), to measure how a model does when shown the format; it is reported as
``few_shot`` and is never the default: held-out accuracy is zero-shot.

``format_rate`` (``peergrade eval``, when the prompts ask for ``<answer>`` tags): the share of
greedy answers that the ``format`` reward in mode ``answer_only`` accepts (one final non-empty
``<answer>...</answer>`` block).

``HeldOut`` is the trainer's held-out evaluator (the run's eval rows, scored zero-shot with the
run's sampling settings before, during and after training) and ``results_table`` its
before/after table; they take the trainer's run duck-typed and never import the trainer.

The scorer (``held_out_scorer``): ``train.eval_reward`` when set, else the training reward:
the mix's only reward (a harness run's: what the harness returns), or the first of several (a
reward model skipped); a scorer that is one of the training rewards takes that reward's
options. The seed (``eval_seed``): greedy answers are drawn with
``eval_seed(train.seed)`` and the k samples with that + 1, whichever path evaluates.

One evaluator, two callers: ``HeldOut`` and ``peergrade eval`` both go through
``evaluate_config`` with the prompts ``components.encode_rows`` makes, so a run's checkpoint
evaluated with ``peergrade eval --model RUN_DIR`` (which reads the run's config.yaml) gets the
same prompts (system prompt, chat template), sampler settings (one ``SamplerSettings``:
temperature, top-k, top-p, stop, length), scorer and seed as the table the run printed.

Episodes (``env:`` set: tools or an environment, docs/environments.md): each held-out answer
is a whole episode (``generation.sample`` with the run's ``env:`` limits), greedy and
sampled as above, scored on its messages as training scores them (``envs.reward_inputs``: the
accuracy reward reads the last message). Two more rates are reported, for the greedy episodes
and (``_sampled``) the k samples: ``tool_call_rate``, the share of episodes that called a tool at
least once, and ``tool_failure_rate``, the share of tool calls that failed (malformed, unknown
tool, bad arguments, raised, timed out; 0 without calls). The rows are then the episode rows
(``components.episode_rows``: the prompt as messages, system prompt first).

Prompts are encoded by ``tasks.prompts.encode_prompts`` and reward columns built by
``rewards.columns_for``, as in training; this module does not train.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from peergrade import distributed as dist
from peergrade import generation
from peergrade.config import Config
from peergrade.errors import InputError, user_input
from peergrade.files import PYTHON_ONLY
from peergrade.generation import SamplerSettings
from peergrade.rewards import (
    RewardSpec,
    TrainerState,
    make_reward_spec,
    required_columns,
    resolve_reward,
    score_rewards,
)
from peergrade.seeds import step_seed
from peergrade.training import checkpoint as ckpt

EVAL_SEED_SALT = 99  # peergrade.seeds: the held-out sampling stream


def eval_seed(seed: int) -> int:
    """The held-out sampling seed of a run seeded ``seed`` (greedy; the k samples use + 1)."""
    return step_seed(seed, 0, salt=EVAL_SEED_SALT)


def held_out_scorer(
    task, rewards: list[RewardSpec], name: str | None = None, options: dict | None = None
) -> tuple[RewardSpec, str]:
    """The reward that decides "correct" on held-out problems, and why it was chosen (for the
    run header): ``name`` (``train.eval_reward``: a reward of the mix by its metric name, or any
    reward spec), else the training reward: the only reward of the mix ``rewards`` (a harness
    run's: what the harness returned, ``harness``), or the first of several that is no reward
    model (a classifier's score says nothing of "correct"; all reward models: the first). The
    task's verifier scores only when it is a training reward (its default mix, or named). A
    scorer that is one of the mix's functions keeps that reward's options (e.g. arithmetic with
    extract: last_number) unless ``options`` are given."""
    if name is not None:
        picked = next((s for s in rewards if s.name == name), None)
        why = "train.eval_reward"
        if picked is None:
            with user_input("train.eval_reward"):
                picked = make_reward_spec(name)
    elif rewards:
        from peergrade.rewards.models import RewardModel

        i = next((i for i, s in enumerate(rewards) if not isinstance(s.fn, RewardModel)), 0)
        picked, n = rewards[i], len(rewards)
        why = "the training reward" if n == 1 else f"the first of the {n} training rewards"
        if i > 0:
            why += " that is no reward model"
        if n == 1 and getattr(picked.fn, "__name__", "") == "harness_reward":
            why = "what the harness returns: the training reward"
    else:
        raise InputError(
            f"task {task.name!r} has no reward to score held-out problems with: name one with "
            "--reward (peergrade eval) or train.eval_reward"
        )
    same = next((s for s in rewards if s.fn is picked.fn), None)
    kwargs = dict(options) if options else dict((same or picked).kwargs)
    spec = RewardSpec(name=(same or picked).name, fn=picked.fn, weight=1.0, kwargs=kwargs)
    return spec, why


def check_reward_columns(
    task, specs: list[RewardSpec], scorer: RewardSpec | None = None, provided=()
) -> None:
    """Before the model loads: every column a reward requires (``rewards.required_columns``)
    exists in the task's rows (a dataset file: non-null in every row, named by row).
    ``scorer``, the held-out scorer when it is not one of ``specs``, is named as such;
    ``provided``: columns the trainer passes itself (episodes' ``environments``)."""
    needed: dict[str, list[str]] = {}
    labelled = [(s, s.name) for s in specs]
    if scorer is not None:
        labelled.append((scorer, f"{scorer.name}, the held-out scorer (train.eval_reward)"))
    for spec, label in labelled:
        for column in required_columns(spec):
            if column not in provided:
                needed.setdefault(column, []).append(label)
    if needed:
        with user_input("data"):
            task.check_columns(needed)


def evaluate_config(
    cfg: Config,
    model,
    tokenizer,
    rows: list[dict],
    prompt_ids: list[list[int]],
    acc: RewardSpec,
    *,
    trainer_state: TrainerState | None = None,
    make_env=None,
    episode_fn=None,
    **options,
) -> dict[str, Any]:
    """``evaluate`` with the run's settings: ``train.eval_samples`` samples per problem drawn
    with the run's own ``SamplerSettings`` (``Config.sampler_settings``: temperature, top-k,
    top-p, stop, length, the episodes' limits) from ``eval_seed(train.seed)``, generated
    ``train.eval_batch_size`` sequences at a time (``Config.eval_generation_batch``: auto = the
    training step's largest generation call, so evaluation never holds more KV cache and
    logits than the step; the draws are keyed, so the numbers do not depend on it);
    ``options`` go to ``evaluate`` (``curve``, ``keep_completions``). With ``make_env`` (the
    run's ``env:``) the answers are episodes and ``rows`` episode rows; with ``episode_fn`` (an
    external agent: ``training.harness.episode_fn``) its episodes instead of the engine's."""
    return evaluate(
        model,
        tokenizer,
        rows,
        prompt_ids,
        acc,
        k=cfg.train.eval_samples,
        settings=cfg.sampler_settings().replace(batch_size=cfg.eval_generation_batch(dist.world())),
        seed=eval_seed(cfg.train.seed),
        make_env=make_env,
        episodes_from=episode_fn,
        extra=[answer_format_spec()] if asks_for_answer_tags(rows) else [],
        trainer_state=trainer_state,
        **options,
    )


def reward_state(task, step: int, max_steps: int, prompts: int, group: int) -> TrainerState:
    """The ``trainer_state`` reward functions get while step ``step`` (1-based) is scored."""
    num_rows = len(task) if hasattr(task, "__len__") else None
    return TrainerState.at_step(step, max_steps, prompts * group, prompts, num_rows)


def accuracy_spec(task, reward: str | None = None, options: dict | None = None) -> RewardSpec:
    """Correctness: ``reward`` if given, else the task's first default reward, called with
    ``options`` as keyword arguments (e.g. ``extract="last_number"``); 1.0 = correct."""
    name = reward or task.default_rewards[0][0]
    return RewardSpec(name=name, fn=resolve_reward(name), weight=1.0, kwargs=dict(options or {}))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct."""
    if not 0 <= c <= n or k > n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_k_curve(counts: list[int], n: int) -> dict[str, float]:
    """``{"pass@1": ..., ..., "pass@n": ...}``: the unbiased pass@j for j = 1..n, averaged over
    problems, from each problem's count of correct samples among its ``n``."""
    if not counts:
        raise ValueError("pass_at_k_curve needs at least one problem")
    return {
        f"pass@{j}": sum(pass_at_k(n, c, j) for c in counts) / len(counts) for j in range(1, n + 1)
    }


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    rows,
    prompt_ids,
    acc: RewardSpec,
    *,
    k: int,
    settings: SamplerSettings,
    seed: int,
    make_env=None,
    episodes_from=None,
    extra: list[RewardSpec] = (),
    trainer_state: TrainerState | None = None,
    curve: bool = False,
    keep_completions: bool = False,
) -> dict[str, Any]:
    """Greedy pass@1 (``settings.greedy()``), sampled pass@1 (mean over k samples per problem,
    ``settings`` with ``n = k``) and pass@k; with ``curve``, also pass@j for every j = 1..k
    (keys ``pass@1`` .. ``pass@{k}``); with ``keep_completions``, the key ``completions``: one
    dict per problem with its greedy and sampled answers and whether each is correct.

    Every answer comes from ``generation.sample``, as training's do: with ``make_env`` (or an
    external agent's ``episodes_from``) each is an episode over the (episode) ``rows``
    (``prompt_ids`` unused; adds the tool rates, module doc), else a reply to ``prompt_ids``.

    ``trainer_state`` is what the reward functions read (default: outside training, step 0)."""
    n_rows = len(rows)

    def answers(s: SamplerSettings, seed_: int):
        samples = generation.sample(
            model,
            tokenizer,
            rows,
            s,
            seed=seed_,
            prompt_ids=prompt_ids,
            make_env=make_env,
            episodes_from=episodes_from,
        )
        return samples, samples.reward_inputs(rows, env_reward=True)  # episodes' own rewards

    def correct(inputs, spec, repeat):
        s = score_rewards([spec], *inputs, on_error="zero", trainer_state=trainer_state)
        return (s.per_fn[spec.name].nan_to_num(0.0) >= 1.0 - 1e-6).view(n_rows, repeat)

    greedy, g_in = answers(settings.greedy(), seed)
    g_ok = correct(g_in, acc, 1)
    sampled, s_in = answers(settings.replace(n=k), seed + 1)
    s_ok = correct(s_in, acc, k)
    c = s_ok.sum(dim=1).tolist()
    out: dict[str, Any] = {
        "pass@1_greedy": g_ok.double().mean().item(),
        "pass@1_sampled": s_ok.double().mean().item(),
        f"pass@{k}": sum(pass_at_k(k, int(ci), k) for ci in c) / n_rows,
        "n": n_rows,
        "k": k,
    }
    if curve:
        out.update(pass_at_k_curve([int(ci) for ci in c], k))
    for spec in extra:  # e.g. the format reward's rate on the greedy and the sampled answers
        out[f"{spec.name}_rate"] = correct(g_in, spec, 1).double().mean().item()
        out[f"{spec.name}_rate_sampled"] = correct(s_in, spec, k).double().mean().item()
    out |= tool_rates(greedy.episodes, "") | tool_rates(sampled.episodes, "_sampled")
    if keep_completions:
        out["completions"] = [
            {
                "prompt": rows[i]["prompt"],
                "columns": {
                    key: v for key, v in rows[i].items() if key not in ("prompt", "environments")
                },
                "greedy": greedy.completions[i],
                "greedy_correct": bool(g_ok[i, 0]),
                "sampled": sampled.completions[i * k : (i + 1) * k],
                "sampled_correct": [bool(x) for x in s_ok[i].tolist()],
            }
            for i in range(n_rows)
        ]
    return out


def tool_rates(episodes: list, suffix: str) -> dict[str, float]:
    """``tool_call_rate`` (episodes with a tool call) and ``tool_failure_rate`` (failed calls
    per call, 0 without calls) of ``episodes``, keys ending in ``suffix``; none for replies."""
    if not episodes:
        return {}
    eps = episodes
    calls = sum(e.tool_calls for e in eps)
    return {
        f"tool_call_rate{suffix}": sum(e.tool_calls > 0 for e in eps) / max(1, len(eps)),
        f"tool_failure_rate{suffix}": sum(e.tool_failures for e in eps) / calls if calls else 0.0,
    }


TOOL_KEYS = (
    "tool_call_rate",
    "tool_call_rate_sampled",
    "tool_failure_rate",
    "tool_failure_rate_sampled",
)


def asks_for_answer_tags(rows: list[dict]) -> bool:
    """Whether any row's prompt (a string or a list of chat messages) mentions ``<answer>``."""
    for row in rows:
        prompt = row["prompt"]
        if isinstance(prompt, str):
            texts = [prompt]
        else:
            texts = [m.get("content", "") for m in prompt if isinstance(m, dict)]
        if any(isinstance(t, str) and "<answer>" in t for t in texts):
            return True
    return False


FORMAT_KEYS = ("format_rate", "format_rate_sampled")  # answer_format_spec's rates in evaluate


def answer_format_spec() -> RewardSpec:
    """The ``format`` reward in mode ``answer_only``, reported as ``format_rate``."""
    return RewardSpec(
        name="format", fn=resolve_reward("format"), weight=1.0, kwargs={"mode": "answer_only"}
    )


def run_eval_command(
    *,
    model: str,
    config: str | None = None,
    overrides: list[tuple[str, Any]] | None = None,
    task: str | None = None,
    task_options: dict | None = None,
    data: str | None = None,
    n: int | None = None,
    k: int | None = None,
    temperature: float | None = None,
    max_new_tokens: int | None = None,
    seed: int | None = None,
    batch_size: int | None = None,
    device: str = "auto",
    reward: str | None = None,
    curve: bool = False,
    few_shot: int = 0,
    few_shot_answer: str = "<answer>{answer}</answer>",
    reward_options: dict | None = None,
    samples: str | None = None,
) -> dict[str, Any]:
    """``peergrade eval``: load ``model``, evaluate on held-out rows of its task, or on the
    first rows of the dataset ``data`` (its eval split when it has one, or the split that the
    task options ``eval_path`` / ``eval_fraction`` name, else the file itself).

    A run directory or checkpoint brings its run's config.yaml: the task, prompts (system
    prompt, chat template), sampling settings, scorer and seed the run's held-out table used;
    ``config`` (a YAML file) is used instead when given, e.g. a recipe's, to evaluate the base
    model as the recipe's run will evaluate it.
    The flags (``task``, ``data``, ``n`` = train.eval_size, ``k`` = train.eval_samples,
    ``temperature``, ``max_new_tokens``, ``seed``, ``batch_size`` = train.eval_batch_size, ``reward`` =
    train.eval_reward) change it where given, and ``overrides`` (``--section.key value``) win
    over both. Without a run config: the config defaults, with 16 new tokens for the bundled
    model, else 128. ``few_shot`` solved training examples go before each prompt (default
    none); ``reward_options`` are keyword arguments for the scorer; ``samples`` is a JSONL file
    written with one line per problem (its answers, see ``evaluate``'s completions)."""
    from peergrade.model.load import load_model, load_tokenizer, resolve_device, resolve_dtype
    from peergrade.training.components import encode_rows

    if (n is not None and n < 1) or (k is not None and k < 1):
        raise InputError(f"eval: --n and --k must be >= 1 (got n={n}, k={k})")
    if few_shot < 0:
        raise InputError(f"eval: --few-shot must be >= 0 (got {few_shot})")
    if temperature is not None and temperature <= 0:
        raise InputError(f"eval: --temperature must be > 0 for sampled pass@k (got {temperature})")
    flags = dict(n=n, k=k, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    flags.update(batch_size=batch_size, reward=reward)
    cfg, run_config, path, given = _eval_config(
        model, config, task, task_options, data, flags, overrides
    )
    the_task, rows, acc, why, make_env = _eval_rows(
        cfg, data, few_shot, few_shot_answer, reward_options
    )
    agent = _eval_harness(cfg)  # before the model loads: a harness that cannot load says so
    tok = load_tokenizer(path)
    dev = resolve_device(device)
    net = load_model(path, dtype=resolve_dtype(cfg.model.dtype, dev), device=str(dev)).eval()
    episodes = make_env is not None or agent is not None
    ids = [] if episodes else encode_rows(cfg, the_task, tok, rows)
    with _harness_episodes(cfg, agent, net, tok) as episode_fn:
        result = evaluate_config(
            cfg, net, tok, rows, ids, acc, curve=curve, keep_completions=samples is not None,
            make_env=make_env, episode_fn=episode_fn,
        )  # fmt: skip
    if agent is not None:
        result["harness"] = cfg.harness.fn
    if samples is not None:  # one JSON line per problem; never half a file under the name
        import json

        lines = (json.dumps(rec) + "\n" for rec in result.pop("completions"))
        ckpt.atomic_write_text(samples, "".join(lines))
    return _labelled(result, cfg, model, acc.name, why, run_config, few_shot, reward_options) | (
        {"checkpoint": path} if path != given else {}
    )


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
def _harness_episodes(cfg: Config, agent, model, tokenizer):
    """The evaluation's episodes through ``agent`` against ``model`` served on a local port
    (``training.harness.episode_fn``, as the trainer's held-out table runs them); None
    without one. The endpoint and any worker processes stop at the end."""
    if agent is None:
        yield None
        return
    from types import SimpleNamespace

    from peergrade.training import harness

    h = cfg.harness
    pool = harness.pool_of(h.fn, h.processes, agent)
    runner = harness.runner_of(cfg, model, tokenizer)
    run = SimpleNamespace(cfg=cfg, harness=agent, harness_runner=runner, harness_pool=pool)
    try:
        yield harness.episode_fn(run)
    finally:
        runner.close()
        if pool is not None:
            pool.close()


def _labelled(result, cfg, model, scorer, why, run_config, few_shot, reward_options) -> dict:
    """``peergrade eval``'s result with what it evaluated: task, model, scorer, seed, config."""
    result["task"] = cfg.data.path or cfg.data.task
    result["model"] = model
    result["scorer"] = scorer
    result["scorer_chosen_by"] = why
    result["seed"] = eval_seed(cfg.train.seed)
    if run_config is not None:
        result["config"] = str(run_config)
    if few_shot:
        result["few_shot"] = few_shot
    if reward_options:
        result["reward_options"] = dict(reward_options)
    return result


def _eval_config(model, config, task, task_options, data, flags: dict, overrides):
    """``peergrade eval``'s config: the run's config.yaml (a run or checkpoint directory), or
    ``config``, or the defaults; the flags where given; ``overrides`` last. Returns ``(cfg,
    the config file read or None, the model directory, the model as named)``."""
    from pathlib import Path

    from peergrade.config import load_config
    from peergrade.model.load import resolve_model_path

    given = resolve_model_path(model)
    # a run dir -> its latest complete checkpoint; a checkpoint's model files are verified
    path = ckpt.resolve_model_dir(given, verify=True)
    run_config = Path(path) / "config.yaml"
    run_config = config if config is not None else (run_config if run_config.is_file() else None)
    base = load_config(run_config)
    keys: list[tuple[str, Any]] = []
    if task is not None:
        keys += [("data.task", task), ("data.path", None), ("data.eval_path", None)]
    options = dict(task_options or {})
    if data is not None:
        keys += [("data.path", data), ("data.eval_path", options.pop("eval_path", None))]
    if options:
        new_source = task is not None or data is not None
        keys.append(
            ("data.task_options", {**({} if new_source else base.data.task_options), **options})
        )
    elif task is not None or data is not None:
        keys.append(("data.task_options", {}))
    max_new_tokens = flags["max_new_tokens"]
    if max_new_tokens is None and run_config is None:
        max_new_tokens = 16 if model == "bundled" else 128
    for key, value in (
        ("train.eval_size", flags["n"]),
        ("train.eval_samples", flags["k"]),
        ("rollout.temperature", flags["temperature"]),
        ("rollout.max_completion_length", max_new_tokens),
        ("train.seed", flags["seed"]),
        ("train.eval_batch_size", flags["batch_size"]),
        ("train.eval_reward", flags["reward"]),
    ):
        if value is not None:
            keys.append((key, value))
    return load_config(run_config, keys + list(overrides or [])), run_config, path, given


def _eval_rows(cfg: Config, data, few_shot: int, few_shot_answer: str, reward_options):
    """The held-out rows ``peergrade eval`` scores and their scorer, all checked before the
    model loads: ``(task, rows, scorer, why it was chosen, the env factory or None)``."""
    from pathlib import Path

    from peergrade.envs.scoring import EPISODE_COLUMNS
    from peergrade.rewards import make_reward_specs
    from peergrade.training.components import build_env, build_task, episode_rows

    make_env = build_env(cfg)  # the run's env: (tools, environment), checked before the model
    the_task = build_task(cfg, make_env)
    d = cfg.data
    if data is not None and not the_task.has_eval and "eval_fraction" not in d.task_options:
        # --data names the rows to evaluate: the file itself is the held-out split
        d.eval_path = d.path
        the_task = build_task(cfg, make_env)
    with user_input("data" if d.path else "task"):
        # before the model loads (seconds for a GGUF): e.g. fewer held-out problems than --n
        rows = the_task.eval_rows(cfg.train.eval_size)
    if few_shot:
        from peergrade.tasks.curriculum import FewShot

        # fade 0: every prompt carries the examples; the pool is training problems only
        rows, _ = FewShot(few_shot, 0, few_shot_answer, the_task, cfg.train.seed).apply(
            rows, step=1
        )
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
        acc, why = held_out_scorer(the_task, mix, cfg.train.eval_reward, reward_options)
    # an env's or a harness's run: its answers are episodes, which start from messages
    episodes = make_env is not None or cfg.harness.fn is not None
    check_reward_columns(the_task, [], acc, EPISODE_COLUMNS if episodes else ())
    if episodes:
        rows = episode_rows(cfg, the_task, rows)
    return the_task, rows, acc, why, make_env


# ----------------------------------------------------------------------------- during training


@dataclass
class HeldOut:
    """The held-out problems (empty for a user dataset without an eval split) and their
    prompt ids; ``evaluate`` scores the current policy on them (zero-shot, always). ``run`` is
    the trainer's (cfg, task, models, accuracy, encode)."""

    run: Any
    rows: list[dict]
    prompt_ids: list[list[int]]

    @classmethod
    def of(cls, run) -> HeldOut:
        n = run.cfg.train.eval_size
        rows = run.task.eval_rows(n) if getattr(run.task, "has_eval", True) else []
        if getattr(run, "make_env", None) is None and getattr(run, "harness", None) is None:
            return cls(run, rows, run.encode(rows))
        from peergrade.training.components import episode_rows

        return cls(run, episode_rows(run.cfg, run.task, rows), [])

    def evaluate(self, after_step: int) -> dict[str, float] | None:
        """Scores after ``after_step`` training steps (reward functions see that global_step)."""
        if not self.rows:
            return None
        # Under torchrun every rank evaluates the same rows (rank 0 logs); FSDP2 unshards.
        with dist.full_weights(self.run.models.policy) as policy:
            return self._evaluate(policy, after_step)

    def _evaluate(self, policy, after_step: int) -> dict[str, float]:
        cfg, models = self.run.cfg, self.run.models
        r = cfg.rollout
        state = reward_state(
            self.run.task, after_step + 1, cfg.train.steps, r.prompts_per_step, r.group_size
        )
        # the same evaluator (settings, scorer, seed) as `peergrade eval --model RUN_DIR`
        return evaluate_config(
            cfg,
            policy,
            models.tokenizer,
            self.rows,
            self.prompt_ids,
            self.run.accuracy,
            trainer_state=state,
            make_env=getattr(self.run, "make_env", None),
            episode_fn=getattr(self.run, "harness_episodes", None),
        )

    def evaluate_logged(self, step: int, display) -> dict[str, float]:
        """An evaluation during the run (``train.eval_every``): its ``eval/*`` metrics, shown
        as one line on ``display`` too."""
        result = self.evaluate(step)
        k = result["k"]
        shown = ("pass@1_greedy", "pass@1_sampled", f"pass@{k}", *FORMAT_KEYS, *TOOL_KEYS)
        values = "  ".join(f"{n} {result[n]:.3f}" for n in shown if n in result)
        at = display.count(step) if hasattr(display, "count") else step  # as the progress line
        display.print(f"eval after step {at} ({result['n']} held-out problems): {values}")
        return {f"eval/{key}": v for key, v in result.items()}


def results_table(display, before: dict, after: dict, k: int) -> None:
    """The before/after table of held-out accuracy (``metrics.Display.table``)."""
    names = ("pass@1_greedy", "pass@1_sampled", f"pass@{k}", *FORMAT_KEYS, *TOOL_KEYS)
    display.table(
        f"held-out accuracy ({before['n']} problems{', episodes' if TOOL_KEYS[0] in before else ''})",
        ["metric", "before", "after", "change"],
        [
            [n, f"{before[n]:.3f}", f"{after[n]:.3f}", f"{after[n] - before[n]:+.3f}"]
            for n in names
            if n in before and n in after
        ],
    )
