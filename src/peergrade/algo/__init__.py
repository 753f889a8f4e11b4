"""peergrade.algo: the pure tensor math of GRPO/PPO (advantages, losses, KL estimators,
off-policy corrections).

Everything here is a function of torch tensors and plain Python numbers: no transformers, no
peergrade.config, no I/O, no distributed calls. See the module docstrings of
``advantages``, ``losses`` and ``offpolicy`` for every formula and its source.

The package exports the six core functions; PPO's token-level helpers (``token_rewards``,
``whiten``, ``masked_std``, ``last_token_index``) are imported from ``peergrade.algo.advantages``.
"""

from peergrade.algo.advantages import gae, group_advantages
from peergrade.algo.losses import kl_divergence, policy_loss, value_loss
from peergrade.algo.offpolicy import off_policy_weights

__all__ = [
    "gae",
    "group_advantages",
    "kl_divergence",
    "off_policy_weights",
    "policy_loss",
    "value_loss",
]
