"""``python -m peergrade.cli`` = ``peergrade`` (the same as ``python -m peergrade``)."""

import sys

from peergrade.cli import main

sys.exit(main())
