"""Training: the step record, the trainer, the shared update, PPO, pipelined rollouts, dynamic sampling, checkpoints, SFT, export.

Import the modules themselves (``from peergrade.training import ...``); this file imports nothing."""
