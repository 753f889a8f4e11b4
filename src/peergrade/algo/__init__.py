"""peergrade.algo: the pure tensor math of GRPO/PPO (advantages, losses, KL estimators).

Everything here is a function of torch tensors and plain Python numbers: no transformers, no
peergrade.config, no I/O, no distributed calls. See the module docstrings of
``advantages`` and ``losses`` for every formula and its source.

The package exports the five core functions; PPO's token-level helpers (``token_rewards``,
``whiten``, ``masked_std``, ``last_token_index``) are imported from ``peergrade.algo.advantages``.
"""

from peergrade.algo.advantages import gae, group_advantages
from peergrade.algo.losses import kl_divergence, policy_loss, value_loss

__all__ = ["gae", "group_advantages", "kl_divergence", "policy_loss", "value_loss"]
