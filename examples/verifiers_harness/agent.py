"""One verifiers 0.4 rollout per episode: ``rollout(row, base_url, model)`` runs verifiers' own
agent loop (``verifiers.v1``: its ``SingleAgentEnv``, interception server, MCP tool server and
chat program) on the row's problem, with the model client pointed at ``base_url``, and returns
the reward verifiers computed. Nothing here imports peergrade.

peergrade trains it with

    peergrade train --config examples/verifiers_harness/config.yaml

The request path: verifiers' chat program -> verifiers' interception server (on 127.0.0.1) ->
its ``EvalClient`` -> ``base_url`` (the episode's endpoint, where peergrade records the turn).

``VF_CLIENT=train`` (with ``VF_TOKENIZER=<the model's directory>``) uses verifiers' training
client instead: it renders every prompt to token ids itself (the ``renderers`` package) and
calls the token-in route ``<base_url>/inference/v1/generate``; peergrade records those tokens
as they are.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
# vf_arith and local_chat are imported by name, here and (vf_arith) in verifiers' tool server
# process, which inherits this environment
if HERE not in sys.path:
    sys.path.insert(0, HERE)
if HERE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))

import verifiers.v1 as vf  # noqa: E402
from vf_arith import ArithData, ArithTask  # noqa: E402

# "local_chat" (local_chat.py): verifiers' chat program run by this interpreter, offline.
# "null": verifiers' own null harness, the same program prepared by `uv` (needs PyPI on first use).
HARNESS = os.environ.get("VF_HARNESS", "local_chat")
MAX_TURNS = 3
# verifiers' subprocess runtime guards the null harness's one-time `uv` preparation with an
# asyncio.Lock shared by all its instances (runtimes/subprocess.py:87): two episodes preparing
# at once on two event loops (each call below runs its own) leave one waiting forever. So the
# first episodes of a process run one at a time until one has prepared the program.
_PREPARED = threading.Event()
_FIRST = threading.Lock()
# verifiers keeps process-wide asyncio objects (the training client's renderer pool and its
# lock) that bind to the first event loop using them; a second loop waiting on them fails
# ("... is bound to a different event loop"). So every rollout of this process runs on one
# event loop, on a thread of its own, whichever thread the trainer calls rollout() on.
_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _run(coro):
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, name="vf-rollouts", daemon=True).start()
    return asyncio.run_coroutine_threadsafe(coro, _LOOP).result()


def client_config(base_url: str):
    """verifiers' model client for ``base_url``. api_key_var: any unset variable (the key sent
    is then "EMPTY"); the default, PRIME_API_KEY, would read the Prime CLI's config."""
    if os.environ.get("VF_CLIENT", "eval") == "train":
        from renderers import DefaultRendererConfig

        return vf.TrainClientConfig(
            base_url=base_url,
            api_key_var="VF_HARNESS_API_KEY",
            # the generic renderer (the tokenizer's own chat template) with the Hermes-style
            # <tool_call> parser the calculator model writes
            renderer=DefaultRendererConfig(tool_parser="qwen3"),
            renderer_model_name=os.environ["VF_TOKENIZER"],
        )
    return vf.EvalClientConfig(base_url=base_url, api_key_var="VF_HARNESS_API_KEY")


async def run_rollout(task: ArithTask, base_url: str, model: str) -> vf.Episode:
    config = vf.SingleAgentEnvConfig(
        taskset={"id": "vf_arith"},
        agent={
            "harness": {"id": HARNESS},
            "max_turns": MAX_TURNS,
            "runtime": {"type": "subprocess"},  # the default (a Prime sandbox) needs a login
        },
    )
    env = vf.SingleAgentEnv(config)
    client = client_config(base_url)
    async with env.serving():
        return await env.run_episode(task, vf.ModelContext(model=model, client=client))


def rollout(row: dict, base_url: str, model: str) -> dict:
    """The row's problem (its ``prompt`` messages, ``a``, ``b`` and ``answer``) as one verifiers
    episode; reward: the trace's (``ArithTask.correct``)."""
    task = ArithTask(
        ArithData(prompt=row["prompt"], a=int(row["a"]), b=int(row["b"]), answer=str(row["answer"]))
    )
    if HARNESS == "null" and not _PREPARED.is_set():
        with _FIRST:
            episode = _run(run_rollout(task, base_url, model))
            if episode.ok:
                _PREPARED.set()
    else:
        episode = _run(run_rollout(task, base_url, model))
    errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
    if not episode.ok or errors:
        raise RuntimeError(
            "verifiers episode failed: " + "; ".join(f"{e.type}: {e.message}" for e in errors)
        )
    (trace,) = episode.traces
    return {
        "reward": float(trace.reward or 0.0),
        "messages": float(len(trace.messages)),
        "token_client": float(os.environ.get("VF_CLIENT") == "train"),  # harness/token_client
    }


if __name__ == "__main__":  # one episode against a running server: peergrade serve --port 8000
    from openai import OpenAI

    url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
    row = {
        "prompt": [{"role": "user", "content": "270*324="}],
        "a": 270,
        "b": 324,
        "answer": "87480",
    }
    print(rollout(row, url, OpenAI(base_url=url, api_key="-").models.list().data[0].id))
