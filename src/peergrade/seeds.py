"""Every seed of a run, derived from (train.seed, step, purpose): what makes resume exact.

``step_seed(seed, step, salt)`` names one random stream of one step by its purpose (``salt``):
0 sampling, 1 + pass minibatch shuffles, 7 the few-shot curriculum, 99 evaluation, 1000 Python's
``random`` and numpy's global generator (for reward functions that use them). A run resumed
at step s therefore draws exactly what an uninterrupted run draws at step s, with no generator
state to carry across.

Pure Python: no torch, no config.
"""

from __future__ import annotations

__all__ = ["step_seed"]


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    """The seed of the random stream ``salt`` of ``step`` in a run seeded with ``seed``."""
    return (seed * 1_000_003 + step * 7919 + salt) % (2**63 - 1)
