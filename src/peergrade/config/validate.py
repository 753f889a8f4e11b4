"""``validate``: the cross-field rules (group size, batch divisibility, ranges, choices), one
check per section, all before any model is loaded; each error names the key and what is
allowed."""

from __future__ import annotations

import difflib
import math
import sys

from peergrade.config.schema import Config
from peergrade.errors import ConfigError


def validate(cfg: Config) -> None:
    """Cross-field rules; raises ConfigError naming the key and what is allowed.

    One check per section, in this order: the first rule broken is the error raised."""
    _check_loss_type(cfg.algo.loss_type)  # a choice, as the Literal keys are checked on load
    _check_rollout(cfg)
    _check_algo_clipping(cfg)
    _check_algo_losses(cfg)
    _check_algo_grpo_only(cfg)
    _check_teacher_url(cfg)
    check_turn_credit(cfg)
    _check_optim(cfg)
    _check_train(cfg)
    _check_dist(cfg)
    _check_model_and_data(cfg)
    _check_rewards(cfg)
    _check_env(cfg)
    _check_harness(cfg)
    _check_episode_sources(cfg)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _check_rollout(cfg: Config) -> None:
    """rollout: sizes and sampling limits, and the options only GRPO (and, for the
    pipelined producer, ddp) has."""
    r, a = cfg.rollout, cfg.algo
    _need(
        r.group_size >= 2 or (a.name == "ppo" and r.group_size >= 1),
        f"rollout.group_size must be >= 2 (a group needs someone to compare with; "
        f"algo.name=ppo allows 1), got {r.group_size}",
    )
    _need(
        r.prompts_per_step >= 1, f"rollout.prompts_per_step must be >= 1, got {r.prompts_per_step}"
    )
    _need(
        r.max_completion_length >= 1,
        f"rollout.max_completion_length must be >= 1, got {r.max_completion_length}",
    )
    _need(r.temperature > 0, f"rollout.temperature must be > 0 for training, got {r.temperature}")
    _need(0 < r.top_p <= 1, f"rollout.top_p must be in (0, 1], got {r.top_p}")
    _need(r.top_k >= 0, f"rollout.top_k must be >= 0 (0 = off), got {r.top_k}")
    _need(
        r.generation_batch_size is None or r.generation_batch_size >= 1,
        f"rollout.generation_batch_size must be >= 1 or null, got {r.generation_batch_size}",
    )
    _need(r.max_rounds >= 1, f"rollout.max_rounds must be >= 1, got {r.max_rounds}")
    _need(
        not r.dynamic_sampling or a.name == "grpo",
        "rollout.dynamic_sampling keeps the groups whose group-relative advantage is nonzero, a "
        "GRPO notion: algo.name=ppo's critic gives groups whose rewards agree an advantage too; "
        "turn rollout.dynamic_sampling off with ppo",
    )
    _need(r.async_steps >= 0, f"rollout.async_steps must be >= 0 (0 = off), got {r.async_steps}")
    _need(
        r.producer_timeout_s >= 0,
        f"rollout.producer_timeout_s must be >= 0 (0 = no limit), got {r.producer_timeout_s}",
    )
    _need(
        r.async_steps == 0 or a.name == "grpo",
        f"rollout.async_steps={r.async_steps} is a GRPO option: algo.name=ppo's critic values "
        "are not pipelined yet; set rollout.async_steps to 0",
    )
    _need(
        r.async_steps == 0 or cfg.dist.strategy != "fsdp",
        f"rollout.async_steps={r.async_steps} needs whole weights on every rank for the "
        "producer's copy: use dist.strategy ddp, or rollout.async_steps 0 with fsdp",
    )
    _check_engine(cfg)


def _check_engine(cfg: Config) -> None:
    """rollout.engine vllm: its sizes, and a pipelined run's producer (a thread)."""
    r = cfg.rollout
    _need(
        r.vllm_server_url is None or (r.engine == "vllm" and r.vllm_mode == "server"),
        f"rollout.vllm_server_url {r.vllm_server_url} is used by rollout.engine vllm with "
        f"rollout.vllm_mode server only (got engine {r.engine}, vllm_mode {r.vllm_mode})",
    )
    if r.engine != "vllm":
        return
    if r.vllm_mode == "server":
        _check_server(r)
        _need(
            cfg.harness.fn is None,
            "rollout.vllm_mode server samples replies and episodes' turns; a harness "
            "(harness.fn) needs rollout.vllm_mode colocate (or rollout.engine peergrade)",
        )
    _need(
        0 < r.vllm_gpu_memory_utilization <= 1,
        "rollout.vllm_gpu_memory_utilization must be in (0, 1], got "
        f"{r.vllm_gpu_memory_utilization}",
    )
    _need(
        r.vllm_kv_cache_gb is None or r.vllm_kv_cache_gb > 0,
        f"rollout.vllm_kv_cache_gb must be > 0 or null, got {r.vllm_kv_cache_gb}",
    )
    _need(
        r.vllm_max_model_len is None or r.vllm_max_model_len >= 1,
        f"rollout.vllm_max_model_len must be >= 1 or null, got {r.vllm_max_model_len}",
    )
    _need(
        r.async_steps == 0 or r.producer != "process",
        "rollout.producer process with rollout.engine vllm: the engine lives in the trainer's "
        "process and a pipelined run's producer shares it as a thread; set rollout.producer "
        "to thread (or auto)",
    )
    _need(
        r.async_steps == 0 or cfg.harness.fn is None,
        "rollout.engine vllm with a harness (harness.fn): the endpoint samples at the weights "
        "vLLM holds now, not a pipelined producer's older version; set rollout.async_steps 0",
    )


def _check_server(r) -> None:
    """rollout.vllm_mode server: the URL's form and the timeout."""
    _need(
        r.vllm_server_timeout > 0,
        f"rollout.vllm_server_timeout must be > 0 seconds, got {r.vllm_server_timeout}",
    )
    url = r.vllm_server_url
    if url is None:
        return
    from urllib.parse import urlparse

    parts = urlparse(url)
    _need(
        parts.scheme in ("http", "https") and bool(parts.hostname),
        f"rollout.vllm_server_url must be http://host:port (a vLLM server), got {url!r}",
    )


def _check_algo_clipping(cfg: Config) -> None:
    """algo: the clipped ratio, KL, iterations and off-policy weights, and PPO's critic."""
    a = cfg.algo
    _need(a.clip_eps > 0, f"algo.clip_eps must be > 0, got {a.clip_eps}")
    _need(
        a.clip_eps_high is None or a.clip_eps_high > 0,
        f"algo.clip_eps_high must be > 0 or null, got {a.clip_eps_high}",
    )
    _need(a.beta >= 0, f"algo.beta must be >= 0, got {a.beta}")
    _need(a.num_iterations >= 1, f"algo.num_iterations must be >= 1, got {a.num_iterations}")
    _need(a.off_policy_cap >= 1, f"algo.off_policy_cap must be >= 1, got {a.off_policy_cap}")
    _need(
        0 <= a.off_policy_low <= 1 <= a.off_policy_high,
        f"algo.off_policy_low must be in [0, 1] and algo.off_policy_high >= 1 (an on-policy "
        f"token, r = 1, is always kept), got [{a.off_policy_low}, {a.off_policy_high}]",
    )
    _need(
        a.off_policy_correction in ("auto", "none") or a.name == "grpo",
        f"algo.off_policy_correction={a.off_policy_correction!r} is a GRPO option: "
        "algo.name=ppo has no off-policy correction yet; set it to none",
    )
    for k in ("gamma", "lam"):
        _need(0 <= getattr(a, k) <= 1, f"algo.{k} must be in [0, 1], got {getattr(a, k)}")
    _need(a.vf_coef > 0, f"algo.vf_coef must be > 0, got {a.vf_coef}")
    _need(a.value_clip_eps > 0, f"algo.value_clip_eps must be > 0, got {a.value_clip_eps}")
    _need(
        a.critic_lr is None or a.critic_lr > 0,
        f"algo.critic_lr must be > 0 or null, got {a.critic_lr}",
    )
    _need(
        a.name != "ppo" or (a.loss_type == "grpo" and a.ratio_level == "token"),
        f"algo.loss_type ({a.loss_type!r}) and algo.ratio_level ({a.ratio_level!r}) are GRPO "
        "options: algo.name=ppo always uses the token-level clipped loss (token mean); leave "
        "them at their defaults ('grpo', 'token')",
    )


#: the built-in algo.loss_type names (algo.loss_registry registers the same eight)
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")


def loss_type_names() -> tuple[str, ...]:
    """The built-in loss names and those given to ``peergrade.register_loss`` in this process.

    A registered loss exists only where its registry was imported (by ``register_loss``), so
    the registry is read from ``sys.modules``: importing it here would bring torch into
    loading a config."""
    registry = sys.modules.get("peergrade.algo.loss_registry")
    extra = () if registry is None else registry.loss_names()
    return LOSS_TYPES + tuple(n for n in extra if n not in LOSS_TYPES)


def _check_loss_type(name: str) -> None:
    names = loss_type_names()
    if name in names:
        return
    close = difflib.get_close_matches(str(name), names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(
        f"algo.loss_type: {name!r} is not allowed; choose one of {', '.join(map(repr, names))}"
        f"{hint}, or add one with peergrade.register_loss"
    )


def _check_algo_losses(cfg: Config) -> None:
    """algo: the loss types' own options (delta, SAPO, VESPO, OPSM, entropy)."""
    a = cfg.algo
    _need(
        a.delta is None or a.delta > 1,
        f"algo.delta must be > 1 (normally > 1 + clip_eps_high) or null, got {a.delta}",
    )
    _need(
        a.delta is None or a.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"),
        f"algo.delta caps the clipped surrogate's ratio: it has no effect with "
        f"algo.loss_type={a.loss_type!r} (TRL ignores it there); use grpo, bnpo, dr_grpo, dapo "
        "or luspo, or set algo.delta to null",
    )
    for k in ("sapo_temperature_pos", "sapo_temperature_neg"):
        _need(getattr(a, k) > 0, f"algo.{k} must be > 0, got {getattr(a, k)}")
    for k in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
        _need(getattr(a, k) >= 0, f"algo.{k} must be >= 0, got {getattr(a, k)}")
    _need(
        a.loss_type != "vespo" or a.ratio_level == "token",
        "algo.loss_type=vespo forms its own sequence-level ratio (the product of the token "
        "ratios): set algo.ratio_level to token",
    )
    _need(
        a.loss_type != "vespo" or a.off_policy_correction not in ("sequence_tis", "sequence_mis"),
        f"algo.loss_type=vespo folds token-level off-policy weights into its sequence ratio: "
        f"algo.off_policy_correction={a.off_policy_correction!r} is not supported with it; use "
        "token_tis, token_mis, auto or none",
    )
    _need(
        a.off_policy_mask_threshold is None or a.off_policy_mask_threshold > 0,
        f"algo.off_policy_mask_threshold must be > 0 or null, got {a.off_policy_mask_threshold}",
    )
    _need(
        0 <= a.top_entropy_quantile <= 1,
        f"algo.top_entropy_quantile must be in [0, 1] (1 = every token), got "
        f"{a.top_entropy_quantile}",
    )
    _need(
        math.isfinite(a.entropy_coef),
        f"algo.entropy_coef must be a finite number, got {a.entropy_coef}",
    )
    _need(
        a.entropy_coef_min <= a.entropy_coef_max,
        f"algo.entropy_coef_min ({a.entropy_coef_min}) must be <= algo.entropy_coef_max "
        f"({a.entropy_coef_max})",
    )
    _need(
        a.entropy_coef_delta >= 0,
        f"algo.entropy_coef_delta must be >= 0, got {a.entropy_coef_delta}",
    )
    _need(a.entropy_target >= 0, f"algo.entropy_target must be >= 0, got {a.entropy_target}")
    _need(
        a.cispo_cap is None or a.cispo_cap > 0,
        f"algo.cispo_cap must be > 0 or null, got {a.cispo_cap}",
    )
    _need(
        a.cispo_cap is None or a.loss_type == "cispo",
        f"algo.cispo_cap caps CISPO's weight: it has no effect with algo.loss_type="
        f"{a.loss_type!r}; use loss_type cispo or set algo.cispo_cap to null",
    )


def check_turn_credit(cfg: Config) -> None:
    """algo.turn_credit: its ranges, and what per-turn advantages cannot combine with."""
    a = cfg.algo
    _need(
        0.0 <= a.turn_gamma <= 1.0,
        f"algo.turn_gamma: expected a number in [0, 1], got {a.turn_gamma}",
    )
    _need(
        a.turn_step_weight >= 0.0,
        f"algo.turn_step_weight: expected a number >= 0, got {a.turn_step_weight}",
    )
    if a.turn_credit == "episode":
        return
    clash = [
        (a.name == "ppo", "algo.name: ppo (its critic gives per-token advantages already)"),
        (a.teacher_path is not None, "algo.teacher_path (distillation)"),
        (a.multi_objective_aggregation != "sum_then_normalize", "GDPO (normalize_then_sum)"),
        (a.advantage_scale == "batch", "algo.advantage_scale: batch (use group or none)"),
        (a.loss_type == "vespo", "algo.loss_type: vespo (one advantage per completion)"),
    ]
    for bad, what in clash:
        _need(not bad, f"algo.turn_credit: {a.turn_credit} cannot be combined with {what}")


def _check_algo_grpo_only(cfg: Config) -> None:
    """algo: GRPO's options left at their defaults with ppo; a critic only with ppo."""
    a = cfg.algo
    grpo_only = {
        "delta": None,
        "multi_objective_aggregation": "sum_then_normalize",
        "off_policy_mask_threshold": None,
        "top_entropy_quantile": 1.0,
        "entropy_coef": 0.0,
        "use_adaptive_entropy": False,
    }
    for k, default in grpo_only.items():
        _need(
            a.name == "grpo" or getattr(a, k) == default,
            f"algo.{k}={getattr(a, k)!r} is a GRPO option: algo.name=ppo does not use it; "
            f"leave it at {default!r}",
        )
    _need(
        a.critic_path is None or a.name == "ppo",
        f"algo.critic_path is set ({a.critic_path!r}) but algo.name is {a.name!r}: only ppo "
        "has a critic",
    )
    _need(
        a.teacher_path is None or a.name == "grpo",
        f"algo.teacher_path is set ({a.teacher_path!r}) but algo.name is {a.name!r}: on-policy "
        "distillation is a GRPO mode",
    )
    _need(a.teacher_coef > 0, f"algo.teacher_coef must be > 0, got {a.teacher_coef}")
    _need(
        a.teacher_path is None or cfg.rollout.async_steps == 0,
        f"algo.teacher_path with rollout.async_steps={cfg.rollout.async_steps}: on-policy "
        "distillation scores the student with the weights that sampled the step; set "
        "rollout.async_steps to 0",
    )
    _need(
        0 <= a.teacher_discount <= 1,
        f"algo.teacher_discount must be in [0, 1], got {a.teacher_discount}",
    )
    _need(
        a.teacher_temperature is None or a.teacher_temperature > 0,
        f"algo.teacher_temperature must be > 0 (or null), got {a.teacher_temperature}",
    )
    _check_teacher_divergence(cfg)
    _need(
        a.teacher_path is None or a.loss_type != "vespo",
        "algo.teacher_path with algo.loss_type=vespo: VESPO needs one advantage per completion, "
        "distillation gives one per token",
    )
    _need(
        a.teacher_path is None or a.off_policy_mask_threshold is None,
        "algo.teacher_path with algo.off_policy_mask_threshold: OPSM needs one advantage per "
        "completion, distillation gives one per token",
    )


def _check_teacher_divergence(cfg: Config) -> None:
    """algo.teacher_divergence top_k: TRL's beta in [0, 1], k >= 1, and no sampled-mode key
    set (they would do nothing)."""
    a = cfg.algo
    _need(
        0.0 <= a.teacher_beta <= 1.0,
        f"algo.teacher_beta must be in [0, 1] (0 forward KL, 1 reverse KL), got {a.teacher_beta}",
    )
    _need(
        isinstance(a.teacher_loss_top_k, int) and a.teacher_loss_top_k >= 1,
        f"algo.teacher_loss_top_k must be an integer >= 1, got {a.teacher_loss_top_k!r}",
    )
    if a.teacher_divergence != "top_k":
        return
    for key, default in (("teacher_baseline", "none"), ("teacher_discount", 0.0)):
        _need(
            getattr(a, key) == default,
            f"algo.{key}={getattr(a, key)!r} shapes the sampled-token advantage: it does nothing "
            f"with algo.teacher_divergence: top_k; leave it at {default!r}",
        )


def _check_teacher_url(cfg: Config) -> None:
    """algo.teacher_url: one teacher (not with teacher_path), an http(s) URL, temperature 1 (an
    endpoint's prompt log-probs are the model's own), and teacher_path's distillation rules."""
    a = cfg.algo
    if a.teacher_url is None:
        return
    _need(
        a.teacher_path is None,
        f"algo.teacher_url ({a.teacher_url!r}) and algo.teacher_path ({a.teacher_path!r}) are "
        "both set: the teacher is either a local model or an endpoint",
    )
    _need(
        a.teacher_url.startswith(("http://", "https://")),
        f"algo.teacher_url: expected an http:// or https:// base URL, got {a.teacher_url!r}",
    )
    _need(a.teacher_timeout > 0, f"algo.teacher_timeout must be > 0, got {a.teacher_timeout}")
    t = a.teacher_temperature if a.teacher_temperature is not None else cfg.rollout.temperature
    _need(
        t == 1.0,
        f"algo.teacher_url with a teacher temperature of {t} (algo.teacher_temperature, else "
        "rollout.temperature): an endpoint's prompt_logprobs are at temperature 1; set "
        "algo.teacher_temperature: 1",
    )
    clash = [
        (a.name != "grpo", f"algo.name: {a.name} (distillation is a GRPO mode)"),
        (cfg.rollout.async_steps != 0, "rollout.async_steps >= 1 (set it to 0)"),
        (a.loss_type == "vespo", "algo.loss_type: vespo (one advantage per completion)"),
        (a.off_policy_mask_threshold is not None, "algo.off_policy_mask_threshold (OPSM)"),
        (a.turn_credit != "episode", f"algo.turn_credit: {a.turn_credit}"),
    ]
    for bad, what in clash:
        _need(not bad, f"algo.teacher_url (on-policy distillation) cannot be combined with {what}")


def _check_optim(cfg: Config) -> None:
    """optim: the optimizer, and minibatches and micro-batches that divide the batch."""
    r, o = cfg.rollout, cfg.optim
    _need(o.lr > 0, f"optim.lr must be > 0, got {o.lr}")
    _need(o.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    _need(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    _need(o.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {o.weight_decay}")
    _need(
        o.max_grad_norm >= 0, f"optim.max_grad_norm must be >= 0 (0 = off), got {o.max_grad_norm}"
    )
    _need(
        len(o.adam_betas) == 2 and all(0 <= b < 1 for b in o.adam_betas),
        f"optim.adam_betas must be two numbers in [0, 1), got {o.adam_betas}",
    )
    batch, mb = cfg.batch_size, cfg.minibatch_size
    _need(mb >= 1, f"optim.minibatch_size must be >= 1 or null, got {o.minibatch_size}")
    _need(
        batch % mb == 0,
        f"optim.minibatch_size ({mb}) must divide the batch rollout.prompts_per_step * "
        f"rollout.group_size = {r.prompts_per_step} * {r.group_size} = {batch}",
    )
    _need(o.micro_batch_size >= 1, f"optim.micro_batch_size must be >= 1, got {o.micro_batch_size}")
    micro = cfg.micro_batch_size
    _need(
        mb % micro == 0,
        f"optim.micro_batch_size ({o.micro_batch_size}) must divide the minibatch size ({mb})",
    )


def _check_train(cfg: Config) -> None:
    """train: the loop, evaluation, checkpoints, alerts and report backends."""
    t = cfg.train
    _need(t.steps >= 1, f"train.steps must be >= 1, got {t.steps}")
    for k in ("eval_every", "save_every", "log_samples"):
        _need(getattr(t, k) >= 0, f"train.{k} must be >= 0, got {getattr(t, k)}")
    _need(t.keep_last >= 1, f"train.keep_last must be >= 1, got {t.keep_last}")
    _need(t.eval_size >= 1, f"train.eval_size must be >= 1, got {t.eval_size}")
    _need(t.eval_samples >= 1, f"train.eval_samples must be >= 1, got {t.eval_samples}")
    _need(
        t.eval_batch_size == "auto" or t.eval_batch_size >= 1,
        f"train.eval_batch_size must be auto or an integer >= 1, got {t.eval_batch_size}",
    )
    _need(t.threads >= 0, f"train.threads must be >= 0, got {t.threads}")
    _need(
        t.audit_judge_requests >= 0,
        f"train.audit_judge_requests must be >= 0 (0 = no judge audit), got "
        f"{t.audit_judge_requests}",
    )
    _need(
        t.reward_timeout_s >= 0,
        f"train.reward_timeout_s must be >= 0 (0 = no limit), got {t.reward_timeout_s}",
    )
    al = t.alerts
    _need(al.window >= 1, f"train.alerts.window must be >= 1, got {al.window}")
    for k in (
        "zero_signal_frac",
        "truncated_frac",
        "length_collapse",
        "entropy_collapse",
        "harness_failed_frac",
    ):
        v = getattr(al, k)
        _need(0 < v <= 1, f"train.alerts.{k} must be in (0, 1], got {v}")
    for k in ("eval_drop", "reward_rise", "component_drop", "repetition", "kl_max", "ratio_max"):
        v = getattr(al, k)
        _need(v > 0, f"train.alerts.{k} must be > 0, got {v}")
    _need(
        len(set(t.report_to)) == len(t.report_to),
        f"train.report_to lists a backend twice: {t.report_to}",
    )


def _check_dist(cfg: Config) -> None:
    """dist: the process group's timeout and gradient buckets."""
    _need(cfg.dist.timeout_s > 0, f"dist.timeout_s must be > 0, got {cfg.dist.timeout_s}")
    _need(cfg.dist.bucket_mb > 0, f"dist.bucket_mb must be > 0, got {cfg.dist.bucket_mb}")


def _check_model_and_data(cfg: Config) -> None:
    """model and data: log-prob chunks, prompt length, few-shot examples, LoRA."""
    _need(
        cfg.model.logprob_chunk_size >= 1,
        f"model.logprob_chunk_size must be >= 1, got {cfg.model.logprob_chunk_size}",
    )
    _need(
        cfg.data.max_prompt_length >= 1,
        f"data.max_prompt_length must be >= 1, got {cfg.data.max_prompt_length}",
    )
    d = cfg.data
    _need(d.few_shot >= 0, f"data.few_shot must be >= 0, got {d.few_shot}")
    _need(
        d.few_shot_fade_steps >= 0,
        f"data.few_shot_fade_steps must be >= 0, got {d.few_shot_fade_steps}",
    )
    lora = cfg.model.lora
    _need(
        lora.r >= 1 and lora.alpha > 0 and 0 <= lora.dropout < 1,
        f"model.lora: r must be >= 1, alpha > 0, dropout in [0, 1); got r={lora.r} alpha={lora.alpha} dropout={lora.dropout}",
    )


def _check_rewards(cfg: Config) -> None:
    """rewards: each item's name and timeout, and train.eval_reward."""
    t = cfg.train
    for i, item in enumerate(cfg.rewards):
        _need(bool(item.name.strip()), f"rewards[{i}].name must not be empty")
        _need(
            item.timeout_s is None or item.timeout_s >= 0,
            f"rewards[{i}].timeout_s must be >= 0 (0 = no limit) or null, got {item.timeout_s}",
        )
    _need(
        t.eval_reward is None or bool(t.eval_reward.strip()),
        "train.eval_reward must be a reward name or null (the training reward)",
    )
    _need(
        not t.eval_train_reward or t.eval_reward is not None,
        "train.eval_train_reward scores the held-out answers with the training reward beside "
        "another scorer: it needs train.eval_reward (with it null, the held-out score already "
        "is the training reward)",
    )


def _check_env(cfg: Config) -> None:
    """env: episode limits, tool settings and the tool / factory references."""
    e = cfg.env
    for k in ("max_turns", "max_tokens_per_turn", "max_tool_output_chars"):
        v = getattr(e, k)
        _need(v is None or v >= 1, f"env.{k} must be >= 1 or null, got {v}")
    _need(
        e.max_tool_calling_iterations is None or e.max_tool_calling_iterations >= 0,
        f"env.max_tool_calling_iterations must be >= 0 or null, got {e.max_tool_calling_iterations}",
    )
    for k in ("timeout_s", "tool_timeout"):
        v = getattr(e, k)
        _need(v is None or v > 0, f"env.{k} must be > 0 or null, got {v}")
    _need(e.tool_concurrency >= 1, f"env.tool_concurrency must be >= 1, got {e.tool_concurrency}")
    for i, spec in enumerate(e.tools):
        _need(
            ":" in spec.strip().strip(":"),
            f"env.tools[{i}] must be 'path/to/file.py:fn' or 'module:fn', got {spec!r}",
        )
    _need(
        e.factory is None or ":" in e.factory.strip().strip(":"),
        f"env.factory must be 'path/to/file.py:Class', 'module:Class' or 'verifiers:MODULE', got {e.factory!r}",
    )


def _check_harness(cfg: Config) -> None:
    """harness: the agent's reference, concurrency and timeout."""
    h = cfg.harness
    _need(
        h.fn is None or ":" in h.fn.strip().strip(":"),
        f"harness.fn must be 'path/to/file.py:fn' or 'module:fn', got {h.fn!r}",
    )
    _need(
        h.concurrency is None or h.concurrency >= 1,
        f"harness.concurrency must be >= 1 or null, got {h.concurrency}",
    )
    _need(
        h.timeout_s is None or h.timeout_s > 0,
        f"harness.timeout_s must be > 0 or null, got {h.timeout_s}",
    )
    _need(
        h.processes == "auto"
        or (
            isinstance(h.processes, int) and not isinstance(h.processes, bool) and h.processes >= 0
        ),
        f"harness.processes must be 'auto' or an integer >= 0 (0 = threads of the trainer), got "
        f"{h.processes!r}",
    )


def _check_episode_sources(cfg: Config) -> None:
    """Conflicts between sections: one episode source, and none with ppo."""
    a, e, h = cfg.algo, cfg.env, cfg.harness
    if h.enabled:
        _need(
            not e.enabled,
            "harness.fn and env.tools / env.factory are two episode sources: the harness runs "
            "its own tools; set one of them",
        )
        _need(a.name != "ppo", "algo.name=ppo does not train episodes (harness.fn is set)")
    if e.enabled:
        _need(
            a.name != "ppo",
            "algo.name=ppo does not train episodes (env.tools / env.factory, --tools / --env are "
            "set): its critic and per-token GAE are not written for tool tokens; use "
            "algo.name=grpo (the default) with tools and environments",
        )
