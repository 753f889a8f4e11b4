"""The parts of a training run, built from the config: the task, the reward mix, the few-shot
curriculum, prompt encoding, the episodes' environment factory (``env:``) and the models
bundle (policy, tokenizer, reference).

``trainer.setup`` assembles a run from these (and from ``Given``: the objects a Python caller
hands over instead of names); ``peergrade memory`` (and the evaluator) use the
same builders so that they see the prompts and models training sees. Each builder turns a bad
name or option into a ``peergrade.errors`` user error before anything heavy loads.

What it deliberately does not do: no optimizer, critic or step (``trainer``, ``update``,
``ppo``), no training loop, no checkpoints.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

from peergrade import distributed as dist
from peergrade.config import Config, ConfigError
from peergrade.envs import check_template, make_env_from_objects, make_env_from_specs
from peergrade.envs.scoring import env_reward, gives_reward
from peergrade.envs.verifiers import is_verifiers_spec
from peergrade.errors import InputError, user_input
from peergrade.files import PYTHON_ONLY
from peergrade.model.load import (
    apply_lora,
    load_model,
    load_tokenizer,
    prepare_model,
    prepare_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
)
from peergrade.rewards import BUILTIN_REWARDS, RewardSpec, make_reward_specs
from peergrade.rewards.models import is_reward_model_name, reward_or_model
from peergrade.tasks import load_task
from peergrade.tasks.curriculum import FewShot
from peergrade.tasks.prompts import chat_template_note, encode_prompts, to_messages
from peergrade.training.judge_local import load_local_backend  # noqa: F401 - registers the judge_model loader
from peergrade.training.update import Models, bf16_cpu_note

__all__ = [
    "Given",
    "build_task",
    "build_rewards",
    "build_env",
    "build_few_shot",
    "check_env_template",
    "encode_rows",
    "episode_rows",
    "epoch_metric",
    "run_header",
    "setup_models",
]


@dataclass
class Given:
    """Objects a Python caller (``peergrade.api``) hands over instead of names in the config;
    each one left ``None`` is built from the config."""

    task: Any = None  # a Task, e.g. in-memory rows (tasks.files.FileTask(data=...))
    reward_fns: list | None = None  # aligned with cfg.rewards: a callable replaces that name
    policy: Any = None  # a loaded PreTrainedModel (model.path then only names it)
    tokenizer: Any = None
    tools: list | None = None  # tool functions: with environment_factory, replace env.tools/factory
    environment_factory: Any = None  # a class (or dict of classes), TRL's environment_factory
    harness: Any = None  # fn(row, base_url, model): replaces harness.fn (training.harness)


def python_only_entries(cfg: Config) -> list[tuple[str, str]]:
    """(key, value) of every ``PYTHON_ONLY`` marker in ``cfg``: what the Python API was given as
    objects that config.yaml cannot name (in-memory datasets, tools defined in ``__main__``)."""
    e = cfg.env
    found = [("data.path", cfg.data.path), ("data.eval_path", cfg.data.eval_path)]
    found += [(f"env.tools[{i}]", t) for i, t in enumerate(e.tools or [])]
    found.append(("env.factory", e.factory))
    return [(k, v) for k, v in found if isinstance(v, str) and v.startswith(PYTHON_ONLY)]


def build_task(cfg: Config, make_env: Any = None):
    """The run's task: ``data:``, or the rows of an environment that brings its own (a
    verifiers taskset: ``make_env.task``), which ``data.path`` may not replace."""
    d = cfg.data
    if isinstance(d.path, str) and d.path.startswith(PYTHON_ONLY):
        given = ", ".join(f"{k}: {v}" for k, v in python_only_entries(cfg))
        raise InputError(
            f"this run was given objects from Python that the command line cannot load ({given}): "
            "its data was a dataset in memory (GRPOTrainer(train_dataset=...)); resume the run "
            "from Python with the same datasets, reward functions and tools: GRPOTrainer(...)"
            ".train(resume_from_checkpoint=RUN_DIR), or save the rows to a .jsonl file and "
            "pass --data FILE"
        )
    own = getattr(make_env, "task", None)
    if own is not None:
        if d.path is not None:
            raise InputError(
                f"data.path ({d.path}) cannot be used with env.factory {cfg.env.factory!r}: the "
                "verifiers taskset's tasks are the data (select them in its load_environment())"
            )
        return own
    with user_input("data"):
        if d.path is not None:
            return load_task(
                "file", path=d.path, eval_path=d.eval_path, columns=d.columns, **d.task_options
            )
        return load_task(d.task, **d.task_options)


def build_rewards(cfg: Config, task, fns: list | None = None) -> list[RewardSpec]:
    """The configured reward mix, or the task's default rewards when none is configured.
    ``fns`` (aligned with ``cfg.rewards``): a callable there is used instead of resolving that
    item's name (the Python API's in-memory reward functions)."""
    fns = fns or [None] * len(cfg.rewards)
    with user_input("rewards"):
        if cfg.rewards:
            # a directory is a reward model (loaded on the training device), else a function
            device = resolve_device(cfg.model.device)
            dtype = resolve_dtype(cfg.model.dtype, device)
            items = [
                (
                    reward_or_model(i.name, device=device, dtype=dtype) if fn is None else fn,
                    i.weight,
                    i.kwargs,
                    i.display_name,
                )
                for i, fn in zip(cfg.rewards, fns)
            ]
        else:
            items = [(name, w, {}, None) for name, w in task.default_rewards]
        specs = make_reward_specs(items)
    if cfg.rewards:  # the user's own functions get a time limit and a thread of their own
        for spec, item, fn in zip(specs, cfg.rewards, fns):
            if fn is not None or not (
                item.name.strip() in BUILTIN_REWARDS or is_reward_model_name(item.name)
            ):
                limit = cfg.train.reward_timeout_s if item.timeout_s is None else item.timeout_s
                spec.timeout_s = limit or math.inf
    if not specs:
        raise InputError(
            f"task {task.name!r} has no default reward: name one with --reward or `rewards:`"
        )
    return specs


def build_env(cfg: Config, tools: list | None = None, environment_factory: Any = None):
    """The checked ``row -> environment`` factory of ``env:`` (tools, environment class), or
    None for single-turn training. Loads the user's files: every problem (a missing file, a
    tool without type hints or docstring, a class without ``reset``) is an error here, before
    any model loads. ``tools`` / ``environment_factory`` (a Python caller's functions and
    class, ``Given``) are used instead of ``env.tools`` / ``env.factory``, with the same checks
    and the other ``env:`` options."""
    e = cfg.env
    options = dict(
        max_tool_calling_iterations=e.max_tool_calling_iterations,
        tool_timeout=e.tool_timeout,
        max_tool_output_chars=e.max_tool_output_chars,
        tool_concurrency=e.tool_concurrency,
    )
    if tools or environment_factory is not None:
        return make_env_from_objects(tools or [], environment_factory, **options)
    if not e.enabled:
        return None
    return make_env_from_specs(e.tools, e.factory, **options)


def env_reward_spec(make_env) -> list[RewardSpec]:
    """The reward ``env`` (the environments' own rewards: ``get_reward()`` or step rewards)
    when the environment class can give one, as TRL adds ``get_reward``; else nothing."""
    if make_env is None or not gives_reward(getattr(make_env, "environment_class", None)):
        return []
    return make_reward_specs([(env_reward, 1.0, {}, "env")])


def check_env_template(cfg: Config, tokenizer=None, make_env=None) -> None:
    """The chat template can render episodes token-exactly (``envs.check_template``) and shows
    the tools to the model (``envs.template.check_tools_rendered``, unless
    ``env.unrendered_tools``), checked on the tokenizer alone (``model.path``'s unless one is
    given), before the model loads. A model's own extra end-of-turn ids (its generation
    config) are checked again when episodes run."""
    from peergrade.envs.template import check_tools_rendered

    if tokenizer is None:
        tokenizer = load_tokenizer(resolve_model_path(cfg.model.path), cfg.model.chat_template)
    else:  # a Python caller's tokenizer, with model.chat_template (TRL's chat_template_path)
        tokenizer = prepare_tokenizer(tokenizer, chat_template=cfg.model.chat_template)
    set_tool_format(make_env, tokenizer)
    eos = tokenizer.eos_token_id
    with user_input("model"):
        check_template(tokenizer, eos_ids=[] if eos is None else [eos])
        if not cfg.env.unrendered_tools:
            check_tools_rendered(tokenizer, getattr(make_env, "tool_schemas", None) or [])


def set_tool_format(make_env, tokenizer) -> None:
    """The environments of ``make_env`` parse tool calls in the format the tokenizer's chat
    template writes them (``model.chat_templates.tool_format``: Hermes ``<tool_call>`` or
    Llama 3 JSON)."""
    if make_env is not None and hasattr(make_env, "tool_format"):
        from peergrade.model.chat_templates import tool_format

        make_env.tool_format = tool_format(getattr(tokenizer, "chat_template", None))


def episode_rows(cfg: Config, task, rows: list[dict]) -> list[dict]:
    """The rows an episode starts from: the prompt as chat messages with the system prompt
    first (``data.system_prompt`` or the task's), as ``encode_rows`` renders a single reply's."""
    system = cfg.data.system_prompt or task.system_prompt
    with user_input("data"):
        return [{**row, "prompt": to_messages(row.get("prompt"), system)} for row in rows]


def build_few_shot(cfg: Config, task) -> FewShot:
    d = cfg.data
    return FewShot(d.few_shot, d.few_shot_fade_steps, d.few_shot_answer, task, cfg.train.seed)


def encode_rows(cfg: Config, task, tokenizer, rows: list[dict]) -> list[list[int]]:
    """Token ids of the rows' prompts as the model sees them (system prompt, chat template)."""
    d = cfg.data
    return encode_prompts(
        rows,
        tokenizer,
        system_prompt=d.system_prompt or task.system_prompt,
        use_chat_template=d.use_chat_template,
        max_prompt_length=d.max_prompt_length,
    )


def setup_models(cfg: Config, policy=None, tokenizer=None) -> Models:
    """Policy and tokenizer; the reference when beta > 0 (the disabled adapter under LoRA).
    A ``policy`` (and ``tokenizer``) object given by a Python caller is used as it is, in its
    own dtype, instead of loading ``model.path``."""
    device = resolve_device(cfg.model.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    path = resolve_model_path(cfg.model.path)
    gc = cfg.gradient_checkpointing_on(device.type)
    template = cfg.model.chat_template  # set on the tokenizer: every prompt and save uses it
    if policy is None:
        tokenizer = load_tokenizer(path, template)
        policy = load_model(path, dtype=dtype, device=str(device), gradient_checkpointing=gc)
    else:
        tokenizer = (
            prepare_tokenizer(tokenizer, chat_template=template)
            if tokenizer is not None
            else load_tokenizer(path, template)
        )
        policy = prepare_model(policy, device=device, gradient_checkpointing=gc)
    if cfg.model.disable_dropout:
        disable_dropout(policy)
    reference = None
    if cfg.model.lora.enabled:
        lc = cfg.model.lora
        policy = apply_lora(
            policy, r=lc.r, alpha=lc.alpha, dropout=lc.dropout, target_modules=lc.target_modules
        )
        if cfg.uses_reference:
            reference = "adapter"
    elif cfg.uses_reference and cfg.model.ref_offload and device.type != "cpu":
        # loaded straight into host memory: never two copies on the device
        reference = load_model(path, dtype=dtype, device="cpu").eval().requires_grad_(False)
    elif cfg.uses_reference:
        reference = copy.deepcopy(policy).eval().requires_grad_(False)
    # FSDP2 under torchrun shards both (before the optimizer sees the parameters)
    return Models(dist.prepare(policy), tokenizer, dist.prepare(reference), device)


def disable_dropout(model) -> None:
    """Every dropout of ``model`` at probability 0: ``nn.Dropout`` modules and the attention
    dropout transformers' attention layers read from an attribute (TRL's disable_dropout)."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
    config = getattr(model, "config", None)
    for name in ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop"):
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)


def model_context(cfg: Config, policy=None) -> tuple[int | None, str]:
    """(the model's context in tokens, where it comes from): ``max_position_embeddings`` of
    the given policy's config, else of ``model.path``'s config.json (read without loading the
    weights); None where neither says (a GGUF file: checked once it is loaded)."""
    import json
    from pathlib import Path

    if policy is not None:
        config = getattr(policy, "config", None)
        return getattr(config, "max_position_embeddings", None), "the model"
    path = Path(resolve_model_path(cfg.model.path))
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None, str(path)
    context = config.get("max_position_embeddings")
    return (context if isinstance(context, int) else None), f"{path}/config.json"


def check_context(cfg: Config, policy=None) -> None:
    """A prompt of ``data.max_prompt_length`` tokens and a completion of
    ``rollout.max_completion_length`` must fit the model's context, else sampling fails
    mid-run: an error naming both and the model's limit, before anything runs."""
    context, where = model_context(cfg, policy)
    if context is None:
        return
    completion, prompt = cfg.rollout.max_completion_length, cfg.data.max_prompt_length
    if completion + prompt <= context:
        return
    room = context - prompt
    advice = (
        f"lower max_completion_length (rollout.max_completion_length) to at most {room}"
        if room >= 1
        else "lower data.max_prompt_length (TRL: max_prompt_length)"
    )
    raise ConfigError(
        f"max_completion_length (rollout.max_completion_length) = {completion} plus "
        f"max_prompt_length (data.max_prompt_length) = {prompt} is more than the model's "
        f"context of {context} tokens (max_position_embeddings in {where}): {advice}, or "
        "max_prompt_length, or use a model with a longer context"
    )


def epoch_metric(task, rows_used: int) -> dict[str, float]:
    """``data/epoch``: passes over a finite dataset's training rows once ``rows_used`` rows have
    been drawn (each epoch a fresh shuffle without replacement; TRL's fractional epoch).
    Generated tasks are endless: no key."""
    if not hasattr(task, "__len__") or not len(task):
        return {}
    return {"data/epoch": rows_used / len(task)}


def eval_batch_line(cfg: Config, world: int = 1, problems: int | None = None) -> str:
    """The start-up line that says how many sequences held-out evaluation generates at once
    (``train.eval_batch_size``, resolved by ``Config.eval_generation_batch``); ``problems``:
    how many held-out problems the run has (default: ``train.eval_size``; a split may hold
    fewer)."""
    t = cfg.train
    size = t.eval_size if problems is None else problems
    n = cfg.eval_generation_batch(world)
    if problems is not None:  # never more than the sampled pass holds
        n = min(n, max(1, size * t.eval_samples))
    why = (
        "train.eval_batch_size auto: the step's largest generation call, so evaluation holds "
        "no more KV cache and logits than a training step"
        if t.eval_batch_size == "auto"
        else "train.eval_batch_size"
    )
    fewer = (
        f" (all the held-out split has; train.eval_size {t.eval_size})"
        if size < t.eval_size
        else ""
    )
    return (
        f"held-out evaluation: {size} problems{fewer} x {t.eval_samples} samples, {n} sequences "
        f"generated at once ({why})"
    )


def run_header(
    cfg: Config,
    task,
    tokenizer,
    scorer: RewardSpec,
    why: str,
    make_env=None,
    held_out: int | None = None,
) -> list[str]:
    """What a user must know before the first step: the scorer (and how it was chosen), how
    many held-out problems are evaluated (``held_out``; default ``train.eval_size``; 0: none,
    and nothing is said of an evaluation), how many epochs the steps make of a dataset, and,
    for plain-text prompts on a tokenizer with a chat template, what the model sees
    (``tasks.prompts.chat_template_note``; not through a harness, whose agent sends what it
    likes, its chat requests always through the template); with episodes (``make_env``), the
    opening prompt as the episodes render it (always through the chat template, with the tool
    schemas)."""
    chosen = f"{scorer.name} ({why}; train.eval_reward picks another)"
    if held_out == 0:  # no evaluation: the scorer still gives the progress line's acc / score
        lines = [
            f"scorer: {chosen}; the progress line's acc is its mean over the step's "
            "completions (called score once a score is neither 0 nor 1)"
        ]
    else:
        lines = [
            f"held-out scorer: {chosen}; pass@1 counts a score of 1.0 as correct",
            eval_batch_line(cfg, dist.world(), held_out),
        ]
    if hasattr(task, "__len__") and len(task):
        n, P, steps = len(task), cfg.rollout.prompts_per_step, cfg.train.steps
        lines.append(
            f"data: {n} training rows, {P} a step: {steps * P / n:.2f} epochs in {steps} steps "
            "(each epoch a fresh shuffle)"
        )
    e = cfg.env
    if e.factory is not None:
        lines.append(
            "environment: reset and step may take "
            + (f"{e.timeout_s:g} s" if e.timeout_s else "unlimited time")
            + " each (env.timeout_s)"
        )
    if e.enabled and not is_verifiers_spec(e.factory):
        lines.append(
            "tools: each call may take "
            + (f"{e.tool_timeout:g} s" if e.tool_timeout else "unlimited time")
            + " (env.tool_timeout), a result is cut at "
            + (f"{e.max_tool_output_chars} characters" if e.max_tool_output_chars else "no length")
            + f" (env.max_tool_output_chars), {e.tool_concurrency} calls at once "
            "(env.tool_concurrency)"
        )
    bf16 = bf16_cpu_note(cfg, resolve_device(cfg.model.device))
    lines += [bf16] if bf16 else []
    first = next(task.train_rows(cfg.train.seed))
    if make_env is not None:
        return lines + [episode_prompt_note(cfg, task, tokenizer, first, make_env)]
    if cfg.harness.fn is not None:  # the agent sends what it likes: data.use_chat_template
        return lines  # does not apply (its chat requests always go through the template)
    note = chat_template_note(
        first["prompt"],
        tokenizer,
        system_prompt=cfg.data.system_prompt or task.system_prompt,
        use_chat_template=cfg.data.use_chat_template,
    )
    return lines + ([note] if note else [])


def episode_prompt_note(cfg: Config, task, tokenizer, row: dict, make_env) -> str:
    """The start-up line of episode mode: the first row's opening messages rendered as the
    episodes render them (chat template, system prompt, tool schemas), before the environment's
    reset adds anything."""
    from peergrade.envs.template import render, renders_tools, tool_names

    (opening,) = episode_rows(cfg, task, [row])
    tools = getattr(make_env, "tool_schemas", None) or None
    try:
        text = tokenizer.decode(
            render(tokenizer, opening["prompt"], add_generation_prompt=True, tools=tools)
        )
    except Exception as e:  # the template check before the model loads says more
        return f"episodes: the chat template could not render the first prompt: {e}"
    shown = repr(text if len(text) <= 240 else text[:150] + " ... " + text[-80:])
    names = tool_names(tools)
    tools_part = ""
    if names:
        tools_part = (
            f" with the schemas of {names}"
            if renders_tools(tokenizer, tools)
            else f" (which shows no tool schemas: the model must know {names} already)"
        )
    return (
        f"episodes: every prompt goes through the chat template{tools_part}; the first "
        f"one's opening ({len(text)} characters; an environment's reset may add to it): {shown}"
    )
