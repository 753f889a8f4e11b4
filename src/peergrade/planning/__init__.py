"""Planning: the memory estimate and measurement, the budget, sweeps.

Import the modules themselves (``from peergrade.planning import ...``); this file imports nothing."""
