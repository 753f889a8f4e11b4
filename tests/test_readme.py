"""The README stays true: its config reference is the generated one, its Quickstart has two commands."""

from __future__ import annotations

import re
from pathlib import Path

from peergrade.config import to_markdown

README = Path(__file__).resolve().parents[1] / "README.md"


def test_config_reference_matches_code():
    text = README.read_text()
    m = re.search(
        r"<!-- config-reference:start -->\n(.*?)<!-- config-reference:end -->", text, re.S
    )
    assert m, "README lost its config-reference markers"
    assert m.group(1) == to_markdown(), (
        "README config reference is stale: regenerate with `peergrade config --markdown`"
    )


def test_quickstart_has_exactly_two_commands_and_ci_runs_the_second():
    text = README.read_text()
    block = re.search(r"## Quickstart\n\n```bash\n(.*?)```", text, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert len(commands) == 2
    assert "peergrade train" in commands[0]
    ci = (README.parent / ".ci" / "run").read_text()
    assert commands[1] in ci, "CI must call the README's test command"
