"""TRL / open-r1 recipe files for ``peergrade train --trl-config``: ``recipe_overrides`` reads
a recipe YAML (TrlParser's flat layout: model, script and training arguments in one file) into
peergrade config overrides. The training arguments go through ``GRPOConfig``; open-r1's
``reward_funcs`` names map to built-in rewards (``OPEN_R1_REWARDS``)."""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from peergrade.api.trl_config import GRPOConfig
from peergrade.api.trl_fields import _HUB, _IGNORES, _REPORT, _all_fields, _field_kind
from peergrade.config import ConfigError

#: open-r1's reward_funcs names -> (peergrade built-in, kwargs from the recipe's script args)
OPEN_R1_REWARDS: dict[str, tuple[str, Callable[[dict], dict]]] = {
    "accuracy": ("openr1_accuracy", lambda a: {}),
    "format": ("openr1_format", lambda a: {}),
    "tag_count": ("openr1_tag_count", lambda a: {}),
    "reasoning_steps": ("openr1_reasoning_steps", lambda a: {}),
    "length": ("openr1_length", lambda a: {}),
    "cosine": (
        "openr1_cosine",
        lambda a: {
            k: a[f"cosine_{k}"]
            for k in (
                "min_value_wrong",
                "max_value_wrong",
                "min_value_correct",
                "max_value_correct",
                "max_len",
            )
            if f"cosine_{k}" in a
        },
    ),
    "repetition_penalty": (
        "repetition_penalty",
        lambda a: {
            "n": a.get("repetition_n_grams", 3),
            "scale": -float(a.get("repetition_max_penalty", -1.0)),
            "lowercase": True,
        },
    ),
    "soft_overlong_punishment": (
        "overlong_penalty",
        lambda a: {
            "max_length": a.get("max_completion_len", 16384),
            "cache_length": a.get("soft_punish_cache", 4096),
        },
    ),
}
_OPEN_R1_UNSUPPORTED = {
    "code": "code_tests (a 'tests' column; see docs/sandbox.md)",
    "binary_code": "code_tests",
    "ioi_code": "code_tests",
    "cf_code": "code_tests",
    "code_format": "openr1_format plus code_tests",
}

#: TrlParser's model arguments (TRL's ModelConfig) -> what they set
_MODEL_ARGS = {
    "model_name_or_path",
    "model_revision",
    "torch_dtype",
    "dtype",
    "trust_remote_code",
    "attn_implementation",
    "use_peft",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "lora_target_modules",
    "lora_task_type",
}
#: open-r1 / TRL script arguments read here
_SCRIPT_ARGS = {
    "dataset_name",
    "dataset_config",
    "dataset_train_split",
    "dataset_test_split",
    "dataset_prompt_column",
    "system_prompt",
    "reward_funcs",
    "cosine_min_value_wrong",
    "cosine_max_value_wrong",
    "cosine_min_value_correct",
    "cosine_max_value_correct",
    "cosine_max_len",
    "repetition_n_grams",
    "repetition_max_penalty",
    "max_completion_len",
    "soft_punish_cache",
    "chat_template",
    "callbacks",
    "benchmarks",
    "wandb_entity",
    "wandb_project",
    "wandb_run_group",
    "wandb_log_unique_prompts",
    "code_language",
    "code_eval_test_batch_size",
    "code_eval_scoring_mode",
    "parallel_code_exec_per_proc",
    "e2b_router_url",
    "morph_router_url",
    "code_provider",
    "ioi_provider",
    "dataset_mixture",
    "dataset_configs",
    "num_processes",
}
#: script arguments that only matter for what peergrade cannot do here (warned about)
_SCRIPT_IGNORED = {
    "dataset_configs": "a local dataset has no configurations",
    "num_processes": "set by torchrun --nproc-per-node",
    "callbacks": "open-r1's Hub push callbacks",
    "benchmarks": "open-r1's lighteval benchmarks",
    "wandb_entity": _REPORT,
    "wandb_project": "train.project",
    "wandb_run_group": _REPORT,
    "wandb_log_unique_prompts": _REPORT,
    "model_revision": _HUB,
    "attn_implementation": "transformers picks the attention kernel",
    "lora_task_type": "always a causal LM",
    "code_language": "no code reward from recipes",
    "code_eval_test_batch_size": "no code reward from recipes",
    "code_eval_scoring_mode": "no code reward from recipes",
    "parallel_code_exec_per_proc": "no code reward from recipes",
    "e2b_router_url": "no code reward from recipes",
    "morph_router_url": "no code reward from recipes",
    "code_provider": "no code reward from recipes",
    "ioi_provider": "no code reward from recipes",
}


def recipe_overrides(path: str | Path) -> list[tuple[str, Any]]:
    """``[(peergrade key, value), ...]`` from a TRL / open-r1 recipe YAML (model, script and
    training arguments in one flat mapping, as TrlParser reads them)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--trl-config {str(p)!r} does not exist")
    try:
        tree = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--trl-config {str(p)!r} is not valid YAML: {e}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"--trl-config {str(p)!r}: expected a mapping at the top level")
    where = f"--trl-config {str(p)!r}"
    model_args = {k: tree.pop(k) for k in list(tree) if k in _MODEL_ARGS}
    script = {k: tree.pop(k) for k in list(tree) if k in _SCRIPT_ARGS}
    unknown = [k for k in tree if not _field_kind(k)]
    if unknown:
        close = difflib.get_close_matches(unknown[0], _all_fields() + sorted(_SCRIPT_ARGS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}{hint}")
    ignored = [
        f"{k} ({_SCRIPT_IGNORED[k]})" for k in {**model_args, **script} if k in _SCRIPT_IGNORED
    ]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            args = GRPOConfig(**tree)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    ignored += [str(w.message).removeprefix(_IGNORES) for w in caught]
    if ignored:  # one report for the whole file
        warnings.warn(f"{where}: {_IGNORES}{'; '.join(ignored)}", UserWarning, stacklevel=2)
    data = _recipe_data(script, p)
    out = args.to_overrides(_count_rows(data.get("data.path")))
    out.extend(data.items())
    out.extend(_recipe_model(model_args, where))
    names = script.get("reward_funcs")
    if names is not None:
        out.append(("rewards", _recipe_rewards(names, script, args.reward_weights, where)))
    return out


def _recipe_data(script: dict, recipe: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    name = script.get("dataset_name")
    if script.get("dataset_mixture"):
        raise ConfigError("dataset_mixture is not supported: give one local dataset_name")
    if name is not None:
        local = Path(name).expanduser()
        if not local.is_absolute() and not local.exists():
            local = recipe.parent / local  # a path relative to the recipe
        if not local.exists():
            raise ConfigError(
                f"dataset_name {name!r} is not a local file or save_to_disk directory: peergrade "
                "cannot download from the Hugging Face Hub here. Save it first (datasets."
                "load_dataset(...).save_to_disk('dir') on a machine with network) and give "
                "that path"
            )
        out["data.path"] = str(local)
    if script.get("dataset_config"):
        raise ConfigError(
            f"dataset_config {script['dataset_config']!r}: save that configuration to disk "
            "and give its directory as dataset_name"
        )
    if script.get("chat_template"):
        raise ConfigError(
            "chat_template is not supported in a recipe: save the template in the model's "
            "tokenizer (tokenizer.chat_template = ...; tokenizer.save_pretrained(dir))"
        )
    if script.get("dataset_train_split", "train") != "train":
        raise ConfigError(
            f"dataset_train_split {script['dataset_train_split']!r}: peergrade trains on a "
            "save_to_disk directory's 'train' split (or a file's rows)"
        )
    if script.get("dataset_test_split", "test") not in ("test", "validation"):
        raise ConfigError(
            f"dataset_test_split {script['dataset_test_split']!r}: peergrade evaluates on the "
            "'test' or 'validation' split of a save_to_disk directory"
        )
    prompt_column = script.get("dataset_prompt_column")
    if prompt_column and prompt_column != "prompt":
        out["data.columns"] = {"prompt": prompt_column}
    if script.get("system_prompt"):
        out["data.system_prompt"] = script["system_prompt"]
    return out


def _count_rows(path: str | None) -> int | None:
    if path is None:
        return None
    from peergrade.tasks.files import read_rows

    rows, _ = read_rows(path)
    return len(rows)


def _recipe_model(model_args: dict, where: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    if "model_name_or_path" in model_args:
        out.append(("model.path", str(model_args["model_name_or_path"])))
    if model_args.get("trust_remote_code"):
        raise ConfigError(f"{where}: trust_remote_code is not supported (standard architectures)")
    dtype = model_args.get("dtype", model_args.get("torch_dtype"))
    if dtype not in (None, "auto"):
        out.append(("model.dtype", str(dtype)))
    if model_args.get("use_peft"):
        out.append(("model.lora.enabled", True))
        for ours, theirs in (("r", "lora_r"), ("alpha", "lora_alpha"), ("dropout", "lora_dropout")):
            if theirs in model_args:
                out.append((f"model.lora.{ours}", model_args[theirs]))
        if model_args.get("lora_target_modules"):
            out.append(("model.lora.target_modules", list(model_args["lora_target_modules"])))
    return out


def _recipe_rewards(names, script: dict, weights, where: str) -> list[dict]:
    if isinstance(names, str):
        names = [names]
    if weights is not None and len(weights) != len(names):
        raise ConfigError(
            f"{where}: reward_weights has {len(weights)} entries for {len(names)} reward_funcs"
        )
    items = []
    for i, name in enumerate(names):
        if name in _OPEN_R1_UNSUPPORTED:
            raise ConfigError(
                f"{where}: reward_funcs[{i}] {name!r} (open-r1's remote code execution) is not "
                f"supported from a recipe: use {_OPEN_R1_UNSUPPORTED[name]}"
            )
        if name not in OPEN_R1_REWARDS:
            # not an open-r1 name: a peergrade built-in, module:fn or file.py:fn as it is
            items.append({"name": name})
        else:
            builtin, kwargs = OPEN_R1_REWARDS[name]
            items.append({"name": builtin, "kwargs": kwargs(script), "display_name": name})
        items[-1]["weight"] = 1.0 if weights is None else float(weights[i])
    return items
