"""Reward functions: the TRL-compatible contract, built-in verifiers, and batch scoring.

``resolve_reward`` turns a name into a function, ``score_rewards`` runs a weighted mix of them
on a batch under the error policy, and the built-ins live in submodules (``math``, ``format``,
``countdown``, ``penalties``, ``code``) imported lazily by name. See ``registry`` for the
contract and ``extract`` for the answer-extraction rules and their reward-hacking guards.

This package does not load models or tokenizers and does not compute advantages.
"""

from .registry import (
    BUILTIN_REWARDS,
    CONTRACT_KWARGS,
    RewardError,
    RewardSampleErrors,
    RewardScores,
    RewardSpec,
    TrainerState,
    available_rewards,
    columns_for,
    make_reward_spec,
    make_reward_specs,
    required_columns,
    resolve_reward,
    score_rewards,
)

__all__ = [
    "BUILTIN_REWARDS",
    "CONTRACT_KWARGS",
    "RewardError",
    "RewardSampleErrors",
    "RewardScores",
    "RewardSpec",
    "TrainerState",
    "available_rewards",
    "columns_for",
    "make_reward_spec",
    "make_reward_specs",
    "required_columns",
    "resolve_reward",
    "score_rewards",
]
