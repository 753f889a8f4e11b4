"""examples/convert_tool: the new user's own agent (agent.py: the plain openai client, the real
``convert`` tool, its own reward), trained through ``--harness`` with harness.yaml
(docs/environments.md, 'Your tools on your model')."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from cli_helper import ROOT, imported_modules

pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

EXAMPLE = ROOT / "examples" / "convert_tool"


@pytest.fixture
def example(monkeypatch):
    """agent.py imported as the harness imports it (its folder importable: it imports
    convert_tool from next to it)."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    spec = importlib.util.spec_from_file_location("convert_agent_under_test", EXAMPLE / "agent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_agent_imports_nothing_of_peergrade():
    names = imported_modules(EXAMPLE / "agent.py")
    assert not [x for x in names if x.split(".")[0] == "peergrade"]
    assert "openai" in names and "convert_tool" in names


def test_the_agent_offers_the_schema_the_warm_up_renders(example):
    """`peergrade sft --tools convert_tool.py:convert` renders the schema derived from the
    function; the agent's hand-written one must be the same, or the warmed-up model is asked in
    a system turn it never saw."""
    from peergrade.envs.tools import tool_schema

    assert [tool_schema(example.convert)] == example.TOOLS


def scripted_server(replies: list[dict], seen: list[dict]) -> httpx.Client:
    """An OpenAI-compatible endpoint that answers each chat request with the next of
    ``replies`` (an assistant message) and keeps the requests' bodies in ``seen``."""

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        message = replies[len(seen) - 1]
        body = {
            "id": f"chatcmpl-{len(seen)}",
            "object": "chat.completion",
            "created": 0,
            "model": "policy",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", **message},
                    "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                }
            ],
        }
        return httpx.Response(200, json=body)

    return httpx.Client(transport=httpx.MockTransport(handle))


def call(arguments: dict) -> dict:
    return {
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "convert", "arguments": json.dumps(arguments)},
            }
        ],
    }


ROW = {"prompt": [{"role": "user", "content": "How many cm is 2.5 m?"}], "answer": "250"}


def test_one_episode_runs_the_real_tool_and_scores_the_answer(example, monkeypatch):
    seen: list[dict] = []
    replies = [
        call({"value": 2.5, "from_unit": "m", "to_unit": "cm"}),
        {"content": "It is 250 cm."},
    ]
    monkeypatch.setattr(example, "HTTP", scripted_server(replies, seen))
    out = example.agent(ROW, "http://policy.test/v1", "policy")
    assert out == {"reward": 1.0, "tool_calls": 1}
    assert seen[0]["tools"] == example.TOOLS and seen[0]["messages"] == ROW["prompt"]
    tool_turn = seen[1]["messages"][-1]
    assert tool_turn["role"] == "tool" and tool_turn["content"] == "250"
    assert tool_turn["tool_call_id"] == "call_0" and tool_turn["name"] == "convert"


def test_a_failing_call_is_shown_to_the_model_and_a_wrong_answer_scores_0(example, monkeypatch):
    seen: list[dict] = []
    replies = [call({"value": 2.5, "from_unit": "metres", "to_unit": "cm"}), {"content": "25"}]
    monkeypatch.setattr(example, "HTTP", scripted_server(replies, seen))
    assert example.agent(ROW, "http://policy.test/v1", "policy") == {
        "reward": 0.0,
        "tool_calls": 1,
    }
    assert seen[1]["messages"][-1]["content"] == "error: KeyError: 'metres'"


def test_two_tiny_steps_train_through_the_agent(tmp_path):
    """harness.yaml as a user runs it (make_data.py, then peergrade train), on a tiny random
    model with the hermes template instead of the warmed-up SmolLM2: both steps train, no episode
    fails, each with a request to the endpoint, the agent's reward and its tool-call count."""
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from peergrade.model.tiny import save_tiny_model

    ex = tmp_path / "examples" / "convert_tool"
    shutil.copytree(EXAMPLE, ex, ignore=shutil.ignore_patterns("*.jsonl", "__pycache__"))
    subprocess.run([sys.executable, str(ex / "make_data.py")], check=True, capture_output=True)
    tiny = save_tiny_model(tmp_path / "tiny", max_position_embeddings=2048)
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "peergrade", "train", "--config", str(ex / "harness.yaml")]
    cmd += ["--model.path", str(tiny), "--model.chat_template", "hermes", "--steps", "2"]
    cmd += ["--rollout.prompts_per_step", "2", "--rollout.group_size", "2"]
    cmd += ["--rollout.max_completion_length", "16", "--train.eval_size", "2"]
    cmd += ["--train.save_every", "0", "--harness.processes", "0", "-o", str(tmp_path / "run")]
    out = subprocess.run(
        cmd, cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "tool_call_rate" in out.stdout  # the held-out table counts the agent's calls
    # the agent's chat requests go through the template: no note that plain prompts are not
    assert "data.use_chat_template" not in out.stdout
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    trained = [m for m in map(json.loads, lines) if "loss/policy" in m]
    assert len(trained) == 2
    for m in trained:
        assert m["harness/failed"] == 0.0 and m["harness/requests_mean"] >= 1
        assert "reward/harness/mean" in m and "harness/tool_calls" in m


def test_the_trl_script_runs_by_import_swap_and_chat_template_path(tmp_path, example):
    """trl_tools.py: a TRL script (`tools=[convert]`, `from peergrade import GRPOConfig,
    GRPOTrainer`, `chat_template_path="hermes"`), one step on a tiny random model whose own
    template shows no tools: the hermes template renders the schema into every prompt, it trains,
    and the held-out table counts tool calls."""
    from peergrade.envs.tools import tool_schema
    from peergrade.model.tiny import save_tiny_model

    ex = tmp_path / "examples" / "convert_tool"
    shutil.copytree(EXAMPLE, ex, ignore=shutil.ignore_patterns("*.jsonl", "__pycache__"))
    subprocess.run([sys.executable, str(ex / "make_data.py")], check=True, capture_output=True)
    tiny = save_tiny_model(tmp_path / "tiny", max_position_embeddings=2048)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, str(ex / "trl_tools.py"), str(tiny), "1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "chat template with the schemas of convert" in out.stdout
    assert "tool_call_rate" in out.stdout
    run = tmp_path / "runs" / "convert-trl"
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len([m for m in map(json.loads, lines) if "loss/policy" in m]) == 1
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    schema = json.dumps(tool_schema(example.convert))
    assert samples and all(f"<tools>\n{schema}\n</tools>" in s["prompt_rendered"] for s in samples)
