"""``python -m peergrade ...``: the command line (``peergrade.cli``), so that the standard launcher
runs it on several processes: ``torchrun --nproc-per-node 2 -m peergrade train ...``.

Nothing else lives here."""

import sys

from peergrade.cli import main

if __name__ == "__main__":
    sys.exit(main())
