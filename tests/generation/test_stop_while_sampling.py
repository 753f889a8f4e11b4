"""A harness run that stops (Ctrl-C, SIGTERM, an error) while the endpoint samples: the call in
flight stops at its next token, no thread is inside the model when the process exits (torch
aborts it otherwise: "terminate called without an active exception"), the stop lands in the
trainer's wait rather than inside the event loop, and the endpoint serves again afterwards."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from cli_helper import ROOT  # noqa: E402
from peergrade.envs.protocol import run_stoppable as run_sync  # noqa: E402
from peergrade.generation.kernel import GenerationCancelled, Hooks, generate  # noqa: E402
from peergrade.model.tiny import TOOL_CHAT_TEMPLATE, build_char_tokenizer, build_tiny_model  # noqa: E402
from peergrade.serving.harness import HarnessRunner  # noqa: E402
from peergrade.serving.server import Job  # noqa: E402
from peergrade.training import harness as training_harness  # noqa: E402

# A model that never ends a turn (its eos logit is pushed down) and is slow at every forward
# (a real torch op, so a thread is inside torch's C++ most of the time): a call of it runs
# until it is cancelled.
ENDLESS = """
import torch
from peergrade.model.tiny import TOOL_CHAT_TEMPLATE, build_char_tokenizer, build_tiny_model


def endless_model():
    tok = build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)
    model, _ = build_tiny_model("qwen2", tok, seed=0, max_position_embeddings=1 << 16)
    heavy = torch.randn(384, 384)
    eos = tok.eos_token_id

    def hook(module, args, out):
        for _ in range(4):
            torch.mm(heavy, heavy)  # keeps the sampling thread inside torch
        out[..., eos] = -1e9
        return out

    model.lm_head.register_forward_hook(hook)
    return model.eval(), tok
"""


def endless_model():
    space: dict = {}
    exec(ENDLESS, space)
    return space["endless_model"]()


def _job(tok, session=None) -> Job:
    ids = tok("q", add_special_tokens=False)["input_ids"]
    return Job(prompt_ids=list(ids), max_tokens=60_000, session=session)


@pytest.mark.parametrize("kept_cache", [False, True], ids=["generate", "sessions"])
def test_interrupt_stops_the_call_in_flight_and_the_engine_serves_again(kept_cache):
    model, tok = endless_model()
    runner = HarnessRunner(model, tok, "p", keep_cache=kept_cache)
    engine = runner.engine
    try:
        fut = engine.submit([_job(tok, "s1" if kept_cache else None)])
        deadline = time.monotonic() + 60
        while engine.calls == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.calls == 1 and not fut.done()  # sampling, and it would not end alone
        t0 = time.monotonic()
        assert runner.stop_sampling(wait_s=30)  # idle within the wait
        assert time.monotonic() - t0 < 20
        with pytest.raises(GenerationCancelled):
            fut.result(timeout=5)
        with pytest.raises(GenerationCancelled):  # refused at once while stopped
            engine.submit([_job(tok)]).result(timeout=5)
        engine.resume()  # what the next HarnessRunner.run does
        short = Job(prompt_ids=_job(tok).prompt_ids, max_tokens=3)
        assert len(engine.submit([short]).result(timeout=60)[0].token_ids) == 3
    finally:
        runner.close()


def test_generate_raises_once_its_cancel_event_is_set():
    tok = build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)
    model, _ = build_tiny_model("qwen2", tok, seed=0)
    cancel = threading.Event()
    seen = []

    def on_tokens(seqs, tokens):
        seen.append(tokens)
        if len(seen) == 3:
            cancel.set()

    with pytest.raises(GenerationCancelled):
        generate(
            model,
            tok,
            ["q"],
            n=1,
            max_new_tokens=50,
            seed=0,
            hooks=Hooks(on_tokens=on_tokens, cancel=cancel),
            eos_token_ids=[0],
        )
    assert len(seen) == 3  # it stopped at the next step
    out = generate(
        model, tok, ["q"], n=1, max_new_tokens=5, seed=0, hooks=Hooks(cancel=threading.Event())
    )
    assert out.completion_ids.shape[1] <= 5


def test_closing_a_run_leaves_no_thread_sampling():
    """``training.harness.close`` (the end of ``train``: its ``finally``) stops the call in
    flight; the endpoint itself stays up for another ``train`` call (Python)."""
    model, tok = endless_model()
    runner = HarnessRunner(model, tok, "p")
    try:
        fut = runner.engine.submit([_job(tok)])
        while runner.engine.calls == 0:
            time.sleep(0.01)
        training_harness.close(SimpleNamespace(harness_pool=None, harness_runner=runner))
        assert not runner.engine._busy and fut.exception(timeout=5) is not None
        assert runner.server._thread.is_alive()
    finally:
        runner.close()


STOPPED_RUN = (
    ENDLESS
    + """
import signal, sys
from types import SimpleNamespace
from openai import OpenAI
from peergrade.errors import Stop
from peergrade.serving.harness import HarnessRunner
from peergrade.training import harness


def agent(row, base_url, model):
    client = OpenAI(base_url=base_url, api_key="-", max_retries=0)
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "q"}])
    return 1.0


def stop(signum, frame):
    raise Stop()


model, tok = endless_model()
runner = HarnessRunner(model, tok, "p")
run = SimpleNamespace(harness_pool=None, harness_runner=runner)
signal.signal(signal.SIGINT, stop)
seen = {"n": 0}


def started(module, args, out):
    seen["n"] += 1
    if seen["n"] == 2:
        print("sampling", flush=True)


model.lm_head.register_forward_hook(started)
try:
    runner.run(agent, [{"q": 1}] * 4, n=2, max_completion_length=60_000, timeout_s=600)
except Stop:
    print("stopped", flush=True)
    sys.exit(130)
finally:
    harness.close(run)
"""
)


def test_a_stop_while_the_endpoint_samples_exits_cleanly(tmp_path):
    """The trainer's path in a child process: a harness run on threads, a stop (the
    trainer's signal handler raises ``Stop``) while its episodes are sampled, then
    ``training.harness.close`` and the interpreter's exit: exit code 130, no abort, no
    traceback of a half-run event loop."""
    script = tmp_path / "stopped_run.py"
    script.write_text(STOPPED_RUN)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    p = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        assert p.stdout.readline().strip() == "sampling"
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130, (p.returncode, err[-3000:])
    assert "stopped" in out
    assert "terminate called" not in err and "Traceback" not in err, err[-3000:]
    assert "Task exception was never retrieved" not in err


SERVED = (
    ENDLESS
    + """
import sys
from peergrade.serving.server import serve

model, tok = endless_model()
serve(model, tok, "p", port=int(sys.argv[1]))
"""
)


def test_ctrl_c_stops_peergrade_serve_with_a_request_in_flight(tmp_path):
    """uvicorn's graceful shutdown waits for open requests: the one being sampled is stopped
    at its next token and answered with an error, so one Ctrl-C ends the server at once."""
    import httpx

    from peergrade.serving.server import Server

    with Server(lambda *a: None) as probe:  # a free port
        port = probe.port
    script = tmp_path / "served.py"
    script.write_text(SERVED)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    p = subprocess.Popen(
        [sys.executable, str(script), str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    answer: dict = {}

    def ask():
        body = {"model": "p", "messages": [{"role": "user", "content": "q"}], "max_tokens": 60_000}
        try:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=300)
            answer["status"] = r.status_code
        except httpx.HTTPError as e:
            answer["error"] = repr(e)

    try:
        url = f"http://127.0.0.1:{port}/v1/models"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        client = threading.Thread(target=ask)
        client.start()
        time.sleep(2)  # the request is being sampled, with no end of its own
        assert client.is_alive()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)  # it would wait for the request forever
        client.join(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 0, (p.returncode, err[-3000:])
    assert "terminate called" not in err and "Traceback" not in err, err[-3000:]
    assert answer.get("status") == 503, answer  # answered: the server is stopping


@pytest.mark.parametrize("exc", [ValueError("bad"), SystemExit(3), KeyboardInterrupt()])
def test_run_sync_raises_what_the_coroutine_raises(exc):
    """The loop runs on a thread of its own; whatever the coroutine raises (its own
    ``sys.exit()`` too) is raised in the caller, and nothing hangs."""

    async def boom():
        await asyncio.sleep(0)
        raise exc

    with pytest.raises(type(exc)):
        run_sync(boom())
    assert run_sync(asyncio.sleep(0, result=5)) == 5


def test_run_sync_from_inside_a_running_loop():
    async def outer():  # a notebook's cell
        return run_sync(asyncio.sleep(0, result=7))

    assert asyncio.run(outer()) == 7


class _Signalled(Exception):
    pass


def test_a_stop_while_run_sync_waits_cancels_the_coroutine_and_goes_on():
    """A signal handler that raises in the caller's thread (the trainer's stop) interrupts
    the wait; the coroutine is cancelled and its cleanup runs before the stop goes on."""
    cleaned = threading.Event()

    async def slow():
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.set()

    def raise_(signum, frame):
        raise _Signalled()

    old = signal.signal(signal.SIGUSR1, raise_)
    try:
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1))
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(_Signalled):
            run_sync(slow())
        assert time.monotonic() - t0 < 30 and cleaned.is_set()
    finally:
        signal.signal(signal.SIGUSR1, old)
