"""The run configuration: one tree of dataclasses, the single source of truth.

Every field carries its documentation in ``metadata["help"]``; ``peergrade config`` prints the
whole resolved tree as commented YAML (the file a user starts from) and the documentation's
configuration reference (docs/reference/configuration.md, written by ``python -m
peergrade.cli.docgen``) is generated from the same place (``to_markdown``).

Loading order: defaults -> YAML file (``--config x.yaml``) -> command-line overrides
(``--algo.beta 0.04``). Every key is checked against the tree (an unknown key names the closest
valid one), every value against its field's type, and ``validate`` checks the cross-field rules
(group size, batch divisibility, ranges, choices) -- all before any model is loaded.

Paths: a relative path in a YAML file (``model.path``, ``data.path``, ``data.eval_path``,
``algo.critic_path``, a reward's ``file.py:fn`` or reward-model directory, ``env.tools`` and
``env.factory``'s ``file.py:name``) is relative to that
file, as ``base:`` is; on the command line it is relative to the working directory. Either way
``load_config`` makes it absolute (a run's saved config.yaml then works from any directory, e.g.
``--resume``) and keeps what was typed in ``Config.given_paths``, which ``to_yaml`` writes as a
comment next to the value. ``train.output_dir`` is where to write, not what to read: it stays
relative to the working directory.

The defaults *are* the CPU demo (`peergrade train` with no arguments): the bundled tiny model
on two-digit arithmetic. Recipes for real models live in configs/.

Values derived from several keys (batch and minibatch sizes, updates per step, whether a
reference is needed, the gradient-checkpointing default) are ``Config`` properties, computed in
this one place. This package knows nothing about torch or transformers; the modules that run a
step (``trainer``, ``update``, ``ppo``, ``memory``) read the config, while ``rollout``,
``models``, ``algo``, ``rewards`` and ``tasks`` take plain arguments.

Modules (this file only re-exports their names, so ``from peergrade.config import X`` is the
one import): ``sections`` (``doc``, the field helper, and the sections for the model and what
it samples: model, lora, data, rewards, rollout, env, harness, dist), ``learner`` (algo, optim,
train, alerts), ``schema`` (the root ``Config``, its derived values, ``off_policy_correction``),
``load`` (YAML files and ``base:``, overrides, paths, type checks, unknown keys),
``validate`` (the cross-field rules) and ``render`` (``to_yaml``, ``to_markdown``,
``all_keys``).
"""

from __future__ import annotations

from peergrade.config.learner import AlertConfig, AlgoConfig, OptimConfig, TrainConfig
from peergrade.config.load import (
    PATH_KEYS,
    _build,
    _set_path,
    load_config,
    load_run_config,
    parse_override_value,
    reward_item,
)
from peergrade.config.render import all_keys, to_markdown, to_yaml
from peergrade.config.schema import Config, off_policy_correction
from peergrade.config.sections import (
    DataConfig,
    DistConfig,
    EnvConfig,
    HarnessConfig,
    LoraConfig,
    ModelConfig,
    RewardItem,
    RolloutConfig,
    doc,
)
from peergrade.config.validate import validate
from peergrade.errors import ConfigError  # the user-error family; importable from here too
from peergrade.files import PYTHON_ONLY

__all__ = [
    "PATH_KEYS",
    "PYTHON_ONLY",
    "AlertConfig",
    "AlgoConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistConfig",
    "EnvConfig",
    "HarnessConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "RewardItem",
    "RolloutConfig",
    "TrainConfig",
    "_build",
    "_set_path",
    "all_keys",
    "doc",
    "load_config",
    "load_run_config",
    "off_policy_correction",
    "parse_override_value",
    "reward_item",
    "to_markdown",
    "to_yaml",
    "validate",
]
