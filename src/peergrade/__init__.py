"""peergrade: GRPO training for language models.

The public entry points are the `peergrade` CLI (``peergrade.cli``), the pure loss and
advantage math in ``peergrade.algo``, the sampler in ``peergrade.rollout`` and the trainer in
``peergrade.trainer``. See docs/index.md for the map.
"""

__version__ = "0.1.0"
