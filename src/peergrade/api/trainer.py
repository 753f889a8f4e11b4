"""TRL's ``GRPOTrainer`` on peergrade's trainer.

``GRPOTrainer(model, reward_funcs, args, train_dataset, ...)`` builds a peergrade ``Config``
from a ``GRPOConfig`` (``trl_config``) and its own arguments, and hands the objects (rows in
memory, reward callables, a loaded model, a tokenizer, TRL's ``tools`` functions and
``environment_factory`` class) to the one trainer (``trainer.setup`` / ``trainer.train``);
there is no second training loop. This module does not train, sample or score anything
itself; it translates and delegates.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from peergrade.api.trl_config import GRPOConfig
from peergrade.config import PYTHON_ONLY, ConfigError, load_config
from peergrade.errors import Terminated


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
