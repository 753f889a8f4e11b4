"""peergrade: GRPO training for language models.

The public entry points: the `peergrade` CLI (``peergrade.cli``); the Python API in TRL's
words, ``from peergrade import GRPOConfig, GRPOTrainer`` (``peergrade.api``); the native one,
``peergrade.train(config)`` with a ``peergrade.Config`` (or ``peergrade.load_config(path)``);
the pure loss and advantage math in ``peergrade.algo`` (``peergrade.register_loss`` adds a
policy loss). They are imported on first use, so
``import peergrade`` stays cheap (no torch). See docs/index.md for the map.
"""

import importlib

__version__ = "0.1.0"

#: public name -> the module that defines it (imported when the name is first read)
_LAZY = {
    "GRPOConfig": "peergrade.api",
    "GRPOTrainer": "peergrade.api",
    "train": "peergrade.api",
    "Config": "peergrade.config",
    "load_config": "peergrade.config",
    "Terminated": "peergrade.errors",
    # the judge reward from Python (rewards.judge; read through the module that installs the
    # judge_model loader)
    "judge_reward": "peergrade.training.judge_local",
    # a policy loss under a new algo.loss_type name (algo.loss_registry)
    "register_loss": "peergrade.algo",
}

__all__ = [
    "Config",
    "GRPOConfig",
    "GRPOTrainer",
    "Terminated",
    "__version__",
    "judge_reward",
    "load_config",
    "register_loss",
    "train",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'peergrade' has no attribute {name!r}")
