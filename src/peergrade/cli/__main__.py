"""``python -m peergrade.cli``: the same as ``peergrade`` (tests/cli_helper.py runs it so)."""

import sys

from peergrade.cli import main

sys.exit(main())
