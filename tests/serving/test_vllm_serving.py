"""The endpoint on vLLM (``Engine(vllm=VllmEngine)``: ``peergrade serve --engine vllm``, harness
training with ``rollout.engine vllm``; issues 51 and 52).

Without vLLM: the config takes a harness with the vLLM engine, and ``peergrade serve --engine
vllm`` is one ``error:`` line naming the install. With vLLM (the ``vllm-cpu`` extra, .ci/run):
the endpoint's greedy replies (chat and text, streamed or not) equal ``VllmEngine.sample``'s on
the bundled model; vLLM's engine is driven step by step (continuous batching): a request that
arrives while a long one samples is answered before it ends, and a request whose client left is
aborted; a harness's episodes are recorded with the tokens the endpoint sent and vLLM's
log-probs, which match the trainer's own forward; and a 2-step harness run with
``rollout.engine vllm`` completes and logs the gap.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import sys
import urllib.request

import pytest
import torch

from cli_helper import cli, train_with_engine
from peergrade import cli as peergrade_cli
from peergrade.config import load_config
from peergrade.generation import SamplerSettings, sample

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm")
MAX_NEW = 8
PROMPTS = ["12+7=", "3*4=", "40-9="]

# ----------------------------------------------------------------------------- no vLLM needed


def test_config_takes_a_harness_with_the_vllm_engine():
    cfg = load_config(None, [("rollout.engine", "vllm"), ("harness.fn", "agent.py:run")])
    assert cfg.rollout.engine == "vllm" and cfg.harness.fn.endswith("agent.py:run")


def test_serve_engine_vllm_without_vllm_is_one_error_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails, as when not installed
    code = peergrade_cli.main(["serve", "--engine", "vllm", "--port", "0"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "--engine vllm" in lines[0] and "peergrade[vllm-cpu]" in lines[0]


def test_peergrade_eval_serves_a_harness_with_the_configs_engine(monkeypatch):
    """peergrade eval of a harness run hands the config's rollout engine (vLLM for a run
    trained with it) to the harness's endpoint, as the trainer's held-out table does."""
    from peergrade.cli import evaluate as cli_evaluate
    from peergrade.training import harness

    seen = {}

    class Runner:
        def close(self):
            seen["closed"] = True

    def runner_of(cfg, model, tokenizer, engine=None):
        seen["engine"] = engine
        return Runner()

    monkeypatch.setattr(harness, "runner_of", runner_of)
    monkeypatch.setattr(harness, "pool_of", lambda *a: None)
    cfg = load_config(None, [("harness.fn", "agent.py:run"), ("harness.processes", 0)])
    engine = object()  # the config's engine (training.sampling.build_engine)
    with cli_evaluate._harness_episodes(cfg, lambda *a: 1.0, None, None, engine) as fn:
        assert callable(fn)
    assert seen == {"engine": engine, "closed": True}


# ----------------------------------------------------------------------------- with vLLM


@pytest.fixture(scope="module")
def served():
    """The bundled model served on vLLM: (model, tokenizer, VllmEngine, Engine, base URL)."""
    pytest.importorskip("vllm")
    pytest.importorskip("uvicorn")
    from peergrade.generation.vllm_engine import VllmEngine
    from peergrade.serving.server import Engine, Server, build_app
    from peergrade.training.components import setup_models

    models = setup_models(load_config(None))
    model, tok = models.policy.eval(), models.tokenizer
    vllm = VllmEngine(kv_cache_gb=0.25)
    vllm.start(model, tok)
    engine = Engine(model, tok, "tiny", vllm=vllm)
    server = Server(build_app(engine)).start()
    yield model, tok, vllm, engine, server.url + "/v1"
    server.stop()
    engine.close()
    vllm.close()


def post(url: str, body: dict, stream: bool = False):
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = r.read().decode()
    if not stream:
        return json.loads(raw)
    return [json.loads(x[6:]) for x in raw.splitlines() if x.startswith("data: {")]


def engine_greedy(vllm, model, tok, prompt_ids) -> list[list[int]]:
    s = sample(
        model,
        tok,
        [{"prompt": str(i)} for i in range(len(prompt_ids))],
        SamplerSettings(n=1, max_new_tokens=MAX_NEW, temperature=0.0),
        seed=0,
        prompt_ids=prompt_ids,
        engine=vllm,
    )
    return s.completion_id_lists()


@needs_vllm
def test_greedy_replies_equal_the_engine_s_sample(served):
    model, tok, vllm, _, url = served
    chats, texts = [], []
    for p in PROMPTS:
        body = {"model": "tiny", "max_tokens": MAX_NEW, "temperature": 0, "return_token_ids": True}
        chats.append(
            post(f"{url}/chat/completions", body | {"messages": [{"role": "user", "content": p}]})
        )
        texts.append(post(f"{url}/completions", body | {"prompt": p}))
    for got in (chats, texts):
        prompts = [r["prompt_token_ids"] for r in got]
        want = engine_greedy(vllm, model, tok, prompts)
        assert [r["choices"][0]["token_ids"] for r in got] == want
        assert any(len(w) > 1 for w in want)  # something to compare
    text = texts[0]["choices"][0]
    assert text["text"] == tok.decode(text["token_ids"], skip_special_tokens=True)


@needs_vllm
def test_a_stream_yields_the_tokens_as_they_come(served):
    *_, url = served
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": MAX_NEW, "temperature": 1.0}
    for seed in range(50):  # a seeded reply of a few tokens (keyed: the same when streamed)
        whole = post(f"{url}/completions", body | {"seed": seed, "return_token_ids": True})
        if len(whole["choices"][0]["token_ids"]) >= 3:
            break
    chunks = post(f"{url}/completions", body | {"seed": seed, "stream": True}, stream=True)
    parts = [c["choices"][0]["text"] for c in chunks if c.get("choices")]
    assert len([p for p in parts if p]) >= 2  # token by token, not one piece at the end
    assert "".join(parts) == whole["choices"][0]["text"]


def long_job(tok, max_tokens: int, on_token=None):
    from peergrade.serving.server import Job

    ids = tok.encode(PROMPTS[1], add_special_tokens=False)
    st = SamplerSettings(1, 1, temperature=1.0)
    return Job(ids, max_tokens, st, seed=3, key=1, on_token=on_token)


@needs_vllm
def test_a_request_joins_the_running_batch_and_is_answered_before_it_ends(served, monkeypatch):
    """Continuous batching: a request submitted while a long one samples (from the long one's
    own token callback, so no timing decides it) is answered while the long one still
    samples."""
    _, tok, _, engine, _ = served
    monkeypatch.setattr(engine, "eos_ids", [])  # the long request runs to its budget
    short: list = []
    seen: list[bool] = []  # per long token: was the short request answered by then?

    def on_token(t: int) -> None:
        if not short:
            short.append(engine.submit([long_job(tok, 2)]))
        seen.append(short[0].done())

    long = engine.submit([long_job(tok, 40, on_token)])
    res = long.result(timeout=300)[0]
    assert len(res.token_ids) == 40 and res.finish == "length"
    assert len(short[0].result(timeout=60)[0].token_ids) == 2
    first_answered = seen.index(True)  # the long request went on after the short one ended
    assert 1 < first_answered < len(seen) - 10


@needs_vllm
def test_a_request_whose_client_left_is_aborted(served, monkeypatch):
    _, tok, vllm, engine, _ = served
    monkeypatch.setattr(engine, "eos_ids", [])
    got: list[int] = []
    futs: list = []

    def on_token(t: int) -> None:
        got.append(t)
        if len(got) == 3:
            assert futs[0].cancel()  # as the endpoint does when the client disconnects
            later.set_result(engine.submit([long_job(tok, 2)]))

    cancelled = engine.cancelled
    later: concurrent.futures.Future = concurrent.futures.Future()
    engine.hold()  # the worker starts it once its future is in ``futs``
    futs.append(engine.submit([long_job(tok, 200, on_token)]))
    engine.release()
    after = later.result(timeout=300).result(timeout=300)  # the worker goes on
    assert len(after[0].token_ids) == 2
    assert 3 <= len(got) < 10 and engine.cancelled == cancelled + 1
    assert not vllm.llm.llm_engine.has_unfinished_requests()  # aborted in vLLM too


@needs_vllm
def test_interrupt_stops_the_running_requests_and_resume_serves_again(served, monkeypatch):
    """``Engine.interrupt`` (a run that stops): the requests in flight fail with
    ``GenerationCancelled`` at the next step and vLLM holds none of them; after ``resume`` the
    endpoint serves again."""
    from peergrade.generation.kernel import GenerationCancelled

    _, tok, vllm, engine, _ = served
    monkeypatch.setattr(engine, "eos_ids", [])
    got: list[int] = []
    stopped: list[bool] = []

    def on_token(t: int) -> None:
        got.append(t)
        if len(got) == 3:  # on the worker's thread: interrupt without waiting for it
            stopped.append(engine.interrupt(wait_s=0))

    fut = engine.submit([long_job(tok, 200, on_token)])
    with pytest.raises(GenerationCancelled):
        fut.result(timeout=300)
    assert 3 <= len(got) < 10
    assert engine.interrupt(wait_s=60)  # idle now
    assert not vllm.llm.llm_engine.has_unfinished_requests()
    engine.resume()
    assert len(engine.submit([long_job(tok, 2)]).result(timeout=300)[0].token_ids) == 2


@needs_vllm
def test_harness_episodes_on_vllm_are_token_exact_with_vllm_logprobs(served):
    """A harness's episodes through the endpoint on vLLM: the recorded completion holds the
    tokens the endpoint sent, and vLLM's log-probs match one forward of the model (the
    trainer's) over the recorded sequences."""
    from peergrade.serving.harness import HarnessRunner
    from test_envs import full_forward_logprobs

    model, tok, vllm, _, _ = served
    sent: dict[str, list[list[int]]] = {}

    def harness(row, base_url, name):
        messages = [{"role": "user", "content": row["q"]}]
        for _ in range(2):
            body = {"model": name, "messages": messages, "return_token_ids": True}
            r = post(f"{base_url}/chat/completions", body)
            sent.setdefault(base_url, []).append(r["choices"][0]["token_ids"])
            messages += [r["choices"][0]["message"], {"role": "user", "content": "again"}]
        return 1.0

    runner = HarnessRunner(model, tok, "tiny", vllm=vllm)
    try:
        rows = [{"q": p} for p in PROMPTS[:2]]
        res = runner.run(harness, rows, n=2, max_completion_length=40, temperature=1.0, seed=5)
    finally:
        runner.close()
    assert [r.error for r in res] == [None] * 4
    eps = [r.episode for r in res]
    for ep in eps:
        sampled = [t for t, m in zip(ep.completion_ids, ep.loss_mask) if m]
        assert sampled and ep.sampler_logprobs
    flat = sorted(t for turns in sent.values() for turn in turns for t in turn)
    assert sorted(t for ep in eps for t, m in zip(ep.completion_ids, ep.loss_mask) if m) == flat
    logp, b = full_forward_logprobs(model, eps, tok.pad_token_id, 1.0)
    mask = b["loss_mask"] > 0
    vllm_lp = torch.zeros_like(logp)
    for i, ep in enumerate(eps):
        vllm_lp[i, : len(ep.sampler_logprobs)] = torch.tensor(ep.sampler_logprobs)
    assert float((vllm_lp - logp)[mask].abs().max()) < 1e-4


@needs_vllm
def test_a_harness_run_with_the_vllm_engine_trains_and_logs_the_gap(tmp_path):
    (tmp_path / "agent.py").write_text(AGENT)
    opts = {
        "rollout.engine": "vllm",
        "rollout.vllm_kv_cache_gb": "0.25",
        "harness.fn": "agent.py:agent",
        "harness.processes": "0",
        "rollout.prompts_per_step": "2",
        "rollout.group_size": "2",
        "rollout.max_completion_length": "24",
        "train.steps": "2",
        "train.eval_size": "2",
        "train.eval_samples": "1",
        "train.display": "plain",
        "train.threads": "1",
    }
    steps = train_with_engine(opts, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for r in steps:
        assert r["harness/failed"] == 0.0
        assert 0 <= r["engine/logp_gap_mean"] <= r["engine/logp_gap_max"] < 1e-4
    # peergrade eval of the run: its harness, served by vLLM as in training, scores as the
    # run's last held-out evaluation did (same keyed seeds, same weights, greedy)
    proc = cli(["eval", "--model", "run", "--json"], tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    last = [r for r in rows if "eval/pass@1_greedy" in r][-1]
    assert got["harness"].endswith("agent.py:agent")
    assert got["pass@1_greedy"] == last["eval/pass@1_greedy"]


#: a harness of the bundled task: one chat request, scored 1 when it has a digit
AGENT = """
import json, urllib.request


def agent(row, base_url, model):
    msgs = row["prompt"] if isinstance(row["prompt"], list) else [
        {"role": "user", "content": row["prompt"]}
    ]
    body = json.dumps({"model": model, "messages": msgs, "max_tokens": 16}).encode()
    req = urllib.request.Request(
        base_url + "/chat/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        text = json.loads(r.read())["choices"][0]["message"]["content"] or ""
    return float(any(c.isdigit() for c in text))
"""
