"""The Python API: TRL's ``GRPOConfig`` and ``GRPOTrainer`` with TRL's names and meaning, and
peergrade's own ``train(config)``.

A TRL script runs here by changing its import line::

    from peergrade import GRPOConfig, GRPOTrainer      # was: from trl import ...

One module per part; their names are re-exported here (``from peergrade.api import X``):

- ``trl_fields``: TRL's ``GRPOConfig`` fields in three tables, ``MAPPED`` (sets a peergrade
  key), ``IGNORED`` (one warning) and ``UNSUPPORTED`` (an error unless at TRL's default);
- ``trl_config``: ``GRPOConfig``, TRL's fields and defaults translated to peergrade keys;
- ``trainer``: ``GRPOTrainer``, which builds a ``Config`` and hands the objects to the one
  trainer (no second training loop);
- ``native``: ``train(config)``, the native API with a ``peergrade.Config``;
- ``recipes``: ``recipe_overrides`` for ``peergrade train --trl-config`` (TRL / open-r1 recipes);
- ``trl_docs``: ``trl_mapping_markdown``, docs/coming-from-trl.md rendered from the tables.

Nothing here trains, samples or scores by itself; it translates and delegates.
"""

from __future__ import annotations

from peergrade.api.native import train
from peergrade.api.recipes import OPEN_R1_REWARDS, recipe_overrides
from peergrade.api.trainer import TRL_NAMES as TRL_NAMES
from peergrade.api.trainer import GRPOTrainer
from peergrade.api.trainer import TrainerState as TrainerState
from peergrade.api.trainer import TrainOutput as TrainOutput
from peergrade.api.trl_config import LOSS_TYPES as LOSS_TYPES
from peergrade.api.trl_config import GRPOConfig
from peergrade.api.trl_docs import NATIVE_DIFFERENCES as NATIVE_DIFFERENCES
from peergrade.api.trl_docs import VERIFIED_AGAINST_TRL as VERIFIED_AGAINST_TRL
from peergrade.api.trl_docs import trl_mapping_markdown
from peergrade.api.trl_fields import IGNORED, MAPPED, UNSUPPORTED
from peergrade.api.trl_fields import OWN_DEFAULTS as OWN_DEFAULTS
from peergrade.api.trl_fields import _field_kind as _field_kind

# the public names; the ones imported ``as`` themselves above are re-exported for callers
# and tests that import them from here
__all__ = [
    "GRPOConfig",
    "GRPOTrainer",
    "IGNORED",
    "MAPPED",
    "OPEN_R1_REWARDS",
    "UNSUPPORTED",
    "recipe_overrides",
    "train",
    "trl_mapping_markdown",
]
