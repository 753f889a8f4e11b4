"""peergrade.algo: the pure tensor math of GRPO/PPO (advantages, losses, KL estimators,
off-policy corrections).

Everything here is a function of torch tensors and plain Python numbers: no transformers, no
peergrade.config, no I/O, no distributed calls. See the module docstrings of
``advantages``, ``losses`` and ``offpolicy`` for every formula and its source.

The package exports the core functions; PPO's token-level helpers (``token_rewards``,
``whiten``, ``masked_std``, ``last_token_index``) are imported from ``peergrade.algo.advantages``.
"""

from peergrade.algo.advantages import gae, group_advantages
from peergrade.algo.losses import (
    adaptive_entropy_coef,
    entropy_bonus,
    high_entropy_mask,
    kl_divergence,
    policy_loss,
    value_loss,
    vespo_weights,
)
from peergrade.algo.offpolicy import off_policy_sequence_mask, off_policy_weights

__all__ = [
    "adaptive_entropy_coef",
    "entropy_bonus",
    "gae",
    "group_advantages",
    "high_entropy_mask",
    "kl_divergence",
    "off_policy_sequence_mask",
    "off_policy_weights",
    "policy_loss",
    "value_loss",
    "vespo_weights",
]
