"""TRL's ``GRPOConfig``: TRL 1.16's field names with TRL's defaults, translated to peergrade
config keys (``to_overrides``, ``to_config``). Which field maps, is ignored or is refused is
in the tables of ``trl_fields``.

Batch semantics are TRL's: ``per_device_train_batch_size`` counts completions; a step
generates ``per_device_train_batch_size x gradient_accumulation_steps x processes`` completions
(or ``generation_batch_size``), that is that many / ``num_generations`` prompts; an optimizer
step sees ``per_device_train_batch_size x gradient_accumulation_steps x processes`` of them.
``max_steps`` counts optimizer steps, as TRL's ``global_step`` does.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any

from peergrade.api.trl_fields import (
    _ELSEWHERE,
    MAPPED,
    UNSUPPORTED,
    _all_fields,
    _field_kind,
    _harmless,
    _trl_default,
    _warn_ignored,
)
from peergrade.config import Config, ConfigError, all_keys, load_config


def _vllm_installed() -> bool:
    """Whether vLLM can be imported here (``use_vllm=True`` samples with it only then)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


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
    vllm_mode: str = "colocate"
    vllm_server_base_url: str | None = None
    vllm_server_host: str = "0.0.0.0"
    vllm_server_port: int = 8000
    vllm_server_timeout: float = 240.0
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
        server = self.use_vllm and self.vllm_mode == "server"  # a URL: no vLLM needed here
        if self.use_vllm and not server and not _vllm_installed():  # said in the one warning
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
        out += self._vllm_overrides()
        if self.vllm_max_model_length is not None:
            out.append(("rollout.vllm_max_model_len", self.vllm_max_model_length))
        dtype = _model_dtype(self.model_init_kwargs)
        if dtype is not None:
            out.append(("model.dtype", dtype))
        return out

    def _vllm_overrides(self) -> list[tuple[str, Any]]:
        """use_vllm and vllm_mode: the engine, in this process or a server (its URL from
        vllm_server_base_url, else vllm_server_host:vllm_server_port)."""
        server = self.use_vllm and self.vllm_mode == "server"
        # a server by URL needs no vLLM here; else without vLLM: the own kernel (said at init)
        vllm = self.use_vllm and (server or _vllm_installed())
        out: list[tuple[str, Any]] = [
            ("rollout.engine", "vllm" if vllm else "peergrade"),
            ("rollout.vllm_mode", self.vllm_mode),
            ("rollout.vllm_server_timeout", float(self.vllm_server_timeout)),
            ("rollout.vllm_gpu_memory_utilization", self.vllm_gpu_memory_utilization),
        ]
        if server:
            host = "127.0.0.1" if self.vllm_server_host == "0.0.0.0" else self.vllm_server_host
            url = self.vllm_server_base_url or f"http://{host}:{self.vllm_server_port}"
            out.append(("rollout.vllm_server_url", url))
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
