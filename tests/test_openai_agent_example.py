"""examples/openai_agent: an agent written only with the openai client, trained by
``peergrade train --config examples/openai_agent/config.yaml`` (a CPU smoke run in a
subprocess)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli_helper import imported_modules, train_harness_example

pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "openai_agent"


def test_the_agent_imports_nothing_of_peergrade():
    names = imported_modules(EXAMPLE / "agent.py")
    assert not [x for x in names if x.split(".")[0] == "peergrade"]
    assert "openai" in names


@pytest.mark.parametrize("fn", ["agent", "responses_agent"])
def test_two_tiny_steps_train_through_the_agent(tmp_path, fn):
    """The chat agent, and the same agent on the Responses API (previous_response_id)."""
    steps = train_harness_example(EXAMPLE, tmp_path, "--harness.fn", f"{EXAMPLE}/agent.py:{fn}")
    assert all(m["harness/split_episodes"] == 0.0 for m in steps)
