"""peergrade's own Python entry point: ``train(config)`` with a ``peergrade.Config`` (or a YAML
file's path), as ``peergrade train --config`` does. It stands apart from the TRL adapter
(``GRPOConfig``, ``GRPOTrainer``) and uses none of it."""

from __future__ import annotations

from pathlib import Path

from peergrade.config import Config, load_config


def train(config: Config | str | Path, *, resume: bool = False, overwrite: bool = False):
    """peergrade's own entry point: train with a ``Config`` (or a YAML file's path) into its
    ``train.output_dir`` (none: a new ``runs/<date>-<time>``; the summary's ``run_dir``);
    returns the summary (``peergrade train --config`` does the same). A directory another
    process is writing is refused (``RunInUseError``, naming its pid)."""
    from peergrade.planning.memory import resolve_checkpointing
    from peergrade.training.trainer import train as run_training

    cfg = config if isinstance(config, Config) else load_config(config)
    resolve_checkpointing(cfg)  # model.gradient_checkpointing auto, before the model loads
    return run_training(cfg, cfg.train.output_dir, resume=resume, overwrite=overwrite)
