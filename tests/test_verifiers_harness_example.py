"""examples/verifiers_harness: verifiers 0.4's own agent loop (``verifiers.v1``: its env,
interception server, MCP tool server and chat program) run as a harness, one verifiers rollout
per episode, trained by ``peergrade train --config examples/verifiers_harness/config.yaml``
(a CPU smoke run in a subprocess; no network: the ``local_chat`` harness)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli_helper import imported_modules, train_harness_example

pytest.importorskip("verifiers.v1")
pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "verifiers_harness"


def test_the_example_imports_nothing_of_peergrade():
    for name in ("agent.py", "vf_arith.py", "local_chat.py"):
        names = imported_modules(EXAMPLE / name)
        assert not [x for x in names if x.split(".")[0] == "peergrade"], name


@pytest.mark.parametrize("client", ["eval", "train"])
def test_two_tiny_steps_train_through_verifiers_rollouts(tmp_path, client):
    """``eval``: verifiers' EvalClient (chat requests); ``train``: its TrainClient, which
    renders the prompts itself and sends token ids to the token-in route."""
    env = {"VF_HARNESS": "local_chat", "VF_CLIENT": client}
    if client == "train":
        pytest.importorskip("renderers")
        from peergrade.model.load import resolve_model_path

        env["VF_TOKENIZER"] = str(resolve_model_path("bundled:tiny-calc"))
    # one prompt of two samples a step and one held-out problem: each episode starts two Python
    # programs (verifiers' chat loop and tool server), which is what this test's time is spent on
    tiny = ["--rollout.prompts_per_step", "1", "--train.eval_size", "1"]
    trained = train_harness_example(
        EXAMPLE, tmp_path, "--harness.concurrency", "4", *tiny, env=env, timeout=900
    )
    for m in trained:
        assert m["harness/messages"] >= 2  # the verifiers trace's messages: prompt and reply
        assert m["harness/token_client"] == float(client == "train")
