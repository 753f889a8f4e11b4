"""peergrade.algo: the pure tensor math of GRPO/PPO (advantages, losses, KL estimators,
off-policy corrections).

Everything here is a function of torch tensors and plain Python numbers: no transformers, no
peergrade.config, no I/O, no distributed calls. See the module docstrings of
``advantages``, ``losses`` and ``offpolicy``, and docs/algorithms.md, for every formula and its
source.

The package exports the core functions, the policy loss's typed options (``LossOptions`` and
one record per loss family, ``loss_options`` from flat ``algo.*`` names) and ``register_loss``,
which adds a policy loss under a new ``algo.loss_type`` name (``loss_registry``). PPO's
token-level helpers (``token_rewards``, ``whiten``, ``masked_std``, ``last_token_index``) are
imported from ``peergrade.algo.advantages``.
"""

from peergrade.algo.advantages import gae, group_advantages
from peergrade.algo.loss_options import (
    CispoLoss,
    ClippedLoss,
    CustomLoss,
    DrGrpoLoss,
    LossBatch,
    LossCounts,
    LossOptions,
    SapoLoss,
    VespoLoss,
    loss_options,
)
from peergrade.algo.loss_registry import LOSS_TYPES, loss_names, register_loss
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
    "LOSS_TYPES",
    "CispoLoss",
    "ClippedLoss",
    "CustomLoss",
    "DrGrpoLoss",
    "LossBatch",
    "LossCounts",
    "LossOptions",
    "SapoLoss",
    "VespoLoss",
    "adaptive_entropy_coef",
    "entropy_bonus",
    "gae",
    "group_advantages",
    "high_entropy_mask",
    "kl_divergence",
    "loss_names",
    "loss_options",
    "off_policy_sequence_mask",
    "off_policy_weights",
    "policy_loss",
    "register_loss",
    "value_loss",
    "vespo_weights",
]
