"""The endpoint under clients that misbehave (``peergrade.serving``): a client that
disconnects, bodies past the limit, a slow tokenisation, values of the wrong type, unknown
routes, a Responses store filled with large entries. Loopback only; no timing is asserted
tighter than several seconds."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from peergrade.serving.server import MAX_BODY_BYTES, Engine, Server, build_app  # noqa: E402

MODEL = "tiny"
QUESTION = [{"role": "user", "content": "1234*5678="}]


@pytest.fixture(scope="module")
def calc():
    """A model of its own (its forward is slowed by a hook in some tests)."""
    from peergrade.model.load import (
        load_model,
        load_tokenizer,
        prepare_tokenizer,
        resolve_model_path,
    )

    path = resolve_model_path("bundled:tiny-calc")
    return load_model(path).eval(), prepare_tokenizer(load_tokenizer(path))


@pytest.fixture
def serve(calc):
    """``serve(**build_app kwargs)`` -> a started server (``.engine`` on it); all stopped after."""
    model, tok = calc
    started = []

    def start(**kw):
        engine = Engine(model, tok, MODEL, window_s=0.01)
        s = Server(build_app(engine, **kw)).start()
        s.engine = engine
        started.append(s)
        return s

    yield start
    for s in started:
        s.engine.interrupt(wait_s=30)
        s.stop()
        s.engine.close()


@pytest.fixture
def slow_forward(calc):
    """Every forward of the model sleeps 20 ms and is counted (``calls[0]``)."""
    model, _ = calc
    calls = [0]

    def hook(module, args):
        calls[0] += 1
        time.sleep(0.02)

    handle = model.register_forward_pre_hook(hook)
    yield calls
    handle.remove()


def _raw_post(server, path: str, body: dict) -> socket.socket:
    """A POST sent on a socket of its own (the test closes it to disconnect)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection((server.host, server.port), timeout=30)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    sock.sendall(head + data)
    return sock


def _wait(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


# ----------------------------------------------------------------------------- disconnects


@pytest.mark.parametrize("stream", [False, True])
def test_a_disconnected_clients_generation_stops(serve, slow_forward, stream):
    """A client that disconnects while its reply is sampled (480 tokens, no eos: ~10 s at
    20 ms a token) stops the sampling at its next token: the model runs far fewer than 480
    forwards, and the engine is idle again well before the reply would have ended. (Before,
    the call ran to its budget while every later request waited.)"""
    s = serve()
    s.engine.eos_ids = []  # the reply runs to max_tokens unless cancelled
    body = {"model": MODEL, "prompt": "1+1=", "max_tokens": 480, "stream": stream}
    sock = _raw_post(s, "/v1/completions", body)
    try:
        assert _wait(lambda: slow_forward[0] >= 5, 30), "sampling never started"
        got = b""
        while stream and b"\r\n\r\n" not in got:  # the stream has begun: its head came
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
    finally:
        sock.close()
    assert _wait(lambda: not s.engine._busy, 60)
    assert slow_forward[0] < 240, f"{slow_forward[0]} forwards after the client left"
    assert s.engine.cancelled >= 1
    # the server serves on
    with httpx.Client(base_url=s.url, timeout=30) as c:
        r = c.post("/v1/completions", json={**body, "max_tokens": 3, "stream": False})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_a_disconnected_clients_row_leaves_a_call_shared_with_others(serve, calc):
    """Two requests sampled in one call: when one client leaves, its row leaves the batch at
    the next token while the other request goes on and is answered in full."""
    model, _ = calc
    rows = []

    def hook(module, args, kwargs):
        rows.append(kwargs["input_ids"].shape[0])
        time.sleep(0.02)

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        s = serve()
        s.engine.eos_ids = []
        s.engine.hold()  # the two requests form one batch, one call (the same settings)
        sock = _raw_post(s, "/v1/completions", {**TEXT, "max_tokens": 480, "temperature": 0})
        result = {}

        def kept():
            with httpx.Client(base_url=s.url, timeout=120) as c:
                body = {**TEXT, "max_tokens": 200, "temperature": 0}
                result["r"] = c.post("/v1/completions", json=body)

        t = threading.Thread(target=kept)
        t.start()
        assert _wait(lambda: s.engine.queued() >= 2, 30)
        s.engine.release()
        assert _wait(lambda: len(rows) >= 10, 30)
        assert rows[-1] == 2  # both rows are being sampled
        sock.close()
        t.join(120)
    finally:
        handle.remove()
    r = result["r"]
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 200
    # the row of the client that left ran far fewer than the other's 200 steps
    assert rows.count(2) < 150, rows.count(2)
    assert rows.count(1) > 50


# ----------------------------------------------------------------------------- size, blocking


def test_the_body_limit_is_a_413_in_openais_shape(serve):
    s = serve(max_body_bytes=4096)
    big = {"model": MODEL, "prompt": "x" * 10_000, "max_tokens": 1}
    with httpx.Client(base_url=s.url, timeout=30) as c:
        r = c.post("/v1/completions", json=big)
        assert r.status_code == 413
        err = r.json()["error"]
        assert err["code"] == "request_too_large" and "4096" in err["message"]
        # a chunked body (no Content-Length) is counted as it comes
        data = json.dumps(big).encode()
        r = c.post(
            "/v1/chat/completions",
            content=(data[i : i + 1000] for i in range(0, len(data), 1000)),
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        # under the limit: served
        r = c.post("/v1/completions", json={**big, "prompt": "1+1="})
        assert r.status_code == 200
    assert MAX_BODY_BYTES == 16 * 2**20


def test_a_slow_tokenisation_does_not_stall_other_routes(serve):
    """While a prompt is tokenised (here: held until the test lets it go), ``GET /v1/models``
    is answered: the tokenisation runs off the event loop."""
    s = serve()
    go, entered = threading.Event(), threading.Event()
    encode = s.engine.encode

    def held(text):
        entered.set()
        go.wait(60)
        return encode(text)

    s.engine.encode = held
    result = {}

    def post():
        with httpx.Client(base_url=s.url, timeout=90) as c:
            result["r"] = c.post(
                "/v1/completions", json={"model": MODEL, "prompt": "1+1=", "max_tokens": 2}
            )

    t = threading.Thread(target=post)
    t.start()
    try:
        assert entered.wait(30)
        with httpx.Client(base_url=s.url, timeout=10) as c:
            r = c.get("/v1/models")
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
    finally:
        go.set()
        t.join(90)
    assert result["r"].status_code == 200


# ----------------------------------------------------------------------------- types, routes


CHAT = {"model": MODEL, "messages": QUESTION, "max_tokens": 2}
TEXT = {"model": MODEL, "prompt": "1+1=", "max_tokens": 2}


@pytest.mark.parametrize(
    "route,body,param",
    [
        ("/v1/chat/completions", {**CHAT, "stream": "false"}, "stream"),
        ("/v1/completions", {**TEXT, "stream": 0}, "stream"),
        ("/v1/chat/completions", {**CHAT, "logprobs": "yes"}, "logprobs"),
        ("/v1/completions", {**TEXT, "echo": 1}, "echo"),
        ("/v1/completions", {**TEXT, "echo": "false"}, "echo"),
        ("/v1/chat/completions", {**CHAT, "return_token_ids": "true"}, "return_token_ids"),
        ("/v1/completions", {**TEXT, "return_token_ids": 1}, "return_token_ids"),
        ("/v1/completions", {**TEXT, "suffix": " and so on"}, "suffix"),
        ("/v1/chat/completions", {**CHAT, "stop": [f"s{i}" for i in range(17)]}, "stop"),
        (
            "/inference/v1/generate",
            {"model": MODEL, "token_ids": [1, 2], "sampling_params": {"stop": ["a"] * 17}},
            "stop",
        ),
    ],
)
def test_values_of_the_wrong_type_are_400s(serve, route, body, param):
    s = serve()
    with httpx.Client(base_url=s.url, timeout=30) as c:
        r = c.post(route, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    if param == "stop":
        assert "16" in err["message"]
    if param == "suffix":
        assert err["code"] == "unsupported_parameter"


def test_booleans_and_16_stop_strings_are_served(serve):
    s = serve()
    with httpx.Client(base_url=s.url, timeout=60) as c:
        stops = [f"s{i}" for i in range(16)]
        r = c.post(
            "/v1/chat/completions",
            json={
                **CHAT,
                "stream": False,
                "logprobs": False,
                "stop": stops,
                "return_token_ids": True,
            },
        )
        assert r.status_code == 200 and "token_ids" in r.json()["choices"][0]
        r = c.post("/v1/completions", json={**TEXT, "echo": True, "suffix": None})
        assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("1+1=")


def test_unknown_routes_and_methods_get_openais_error_shape(serve):
    s = serve()
    with httpx.Client(base_url=s.url, timeout=30) as c:
        r404 = c.get("/v1/nothing-here")
        r405 = c.post("/v1/models", json={})
        r405b = c.get("/v1/chat/completions")
    for r, status in ((r404, 404), (r405, 405), (r405b, 405)):
        assert r.status_code == status
        assert r.headers["content-type"].startswith("application/json")
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]


# ----------------------------------------------------------------------------- responses store


def test_the_responses_store_is_bounded_by_bytes():
    from peergrade.serving.responses import ResponseStore

    store = ResponseStore(max_bytes=10_000)
    for i in range(20):
        store.put(f"r{i}", [{"role": "user", "content": "x" * 3000}], {"id": f"r{i}"})
        assert store.bytes <= 10_000
    assert store.retrieve("r19")["id"] == "r19"
    with pytest.raises(Exception, match="not found"):
        store.retrieve("r0")
    store.put("huge", [{"role": "user", "content": "x" * 20_000}], {"id": "huge"})
    assert store.bytes <= 10_000  # larger than the bound alone: not kept
    store.delete("r19")
    assert store.bytes <= 10_000 and store.bytes >= 0


@pytest.mark.parametrize(
    "metadata,ok",
    [
        ({f"k{i}": "v" for i in range(16)}, True),
        ({f"k{i}": "v" for i in range(17)}, False),
        ({"k" * 64: "v" * 512}, True),
        ({"k" * 65: "v"}, False),
        ({"k": "v" * 513}, False),
        ({"k": 1}, False),
        ("not an object", False),
    ],
)
def test_responses_metadata_is_checked_as_openai_does(serve, metadata, ok):
    s = serve()
    body = {"model": MODEL, "input": "1+1=", "max_output_tokens": 2, "metadata": metadata}
    with httpx.Client(base_url=s.url, timeout=60) as c:
        r = c.post("/v1/responses", json=body)
    if ok:
        assert r.status_code == 200 and r.json()["metadata"] == metadata
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == "metadata"


@pytest.mark.parametrize("partial", [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", b""])
def test_slow_headers_time_out(calc, partial):
    """A client that sends part of its headers (or nothing) and stalls is answered 408 and
    disconnected once the header deadline passes (1 s here), instead of holding the
    connection for ever."""
    model, tok = calc
    engine = Engine(model, tok, MODEL)
    try:
        with Server(build_app(engine), header_timeout_s=1.0) as s:
            with socket.create_connection((s.host, s.port), timeout=20) as sock:
                sock.sendall(partial)
                got, t0 = b"", time.monotonic()
                while chunk := sock.recv(65536):
                    got += chunk
                assert time.monotonic() - t0 < 15
            assert got == b"" or got.startswith(b"HTTP/1.1 408"), got
    finally:
        engine.close()


def test_a_slow_body_times_out(calc):
    """A body that stops coming is answered 408 (or the connection closed) at the body
    deadline (1 s here)."""
    model, tok = calc
    engine = Engine(model, tok, MODEL)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"mo'
    )
    try:
        with (
            Server(build_app(engine), body_timeout_s=1.0) as s,
            socket.create_connection((s.host, s.port), timeout=20) as sock,
        ):
            sock.sendall(head)
            got, t0 = b"", time.monotonic()
            while chunk := sock.recv(65536):
                got += chunk
            assert time.monotonic() - t0 < 15
        assert got == b"" or got.startswith(b"HTTP/1.1 408"), got
    finally:
        engine.close()


# ----------------------------------------------------------------------------- admission


def test_a_request_that_can_never_fit_is_refused_at_once(calc):
    """``n=128, max_tokens=400`` needs more KV cache slots than a 4,000-slot budget: a 400 at
    once, naming the limit, and nothing is sampled."""
    model, tok = calc
    engine = Engine(model, tok, MODEL, max_batch_tokens=4000)
    try:
        with Server(build_app(engine)) as s, httpx.Client(base_url=s.url, timeout=30) as c:
            for route, body in (
                ("/v1/completions", {**TEXT, "n": 128, "max_tokens": 400}),
                ("/v1/chat/completions", {**CHAT, "n": 128, "max_tokens": 400}),
                ("/v1/completions", {**TEXT, "prompt": ["1+1="] * 64, "max_tokens": 100}),
            ):
                r = c.post(route, json=body)
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert err["code"] == "request_too_large"
                assert "4000" in err["message"] and "max-batch-tokens" in err["message"]
            r = c.post("/v1/completions", json={**TEXT, "n": 2, "max_tokens": 4})
            assert r.status_code == 200 and len(r.json()["choices"]) == 2
        assert engine.jobs == 2
    finally:
        engine.close()


def test_a_long_prompt_s_prefill_counts_against_the_budget(calc):
    """Eight rows of a 400-token prompt need about 3,300 KV cache slots, but their prefill
    holds one layer's activations and (sdpa on the CPU) a score per head and token pair for
    all of them at once, several times more: past a 6,000-slot budget, a 400 at once that
    names the prefill; one row of it fits and is answered."""
    from peergrade.serving.server import Job

    model, tok = calc
    engine = Engine(model, tok, MODEL, max_batch_tokens=6000)
    prompt = [tok.encode("1")[0]] * 400
    kv_only = 8 * (len(prompt) + 8 + engine.row_tokens)
    assert kv_only < 6000 < engine.cost([Job(prompt, 8)] * 8)
    try:
        with Server(build_app(engine)) as s, httpx.Client(base_url=s.url, timeout=60) as c:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 8}
            r = c.post("/v1/completions", json={**body, "n": 8})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "request_too_large" and "prefill" in err["message"], err
            r = c.post("/v1/completions", json={**body, "n": 1})
            assert r.status_code == 200, r.text
        assert engine.jobs == 1
    finally:
        engine.close()


def test_requests_past_the_budget_wait_for_the_next_batch(calc):
    """Three requests that each fit but not together are all answered, in batches that keep
    within the budget (here each batch holds at most two of them)."""
    model, tok = calc
    engine = Engine(model, tok, MODEL, window_s=0.2)
    one = engine.cost(engine_jobs(tok, 4, 64))
    engine.max_batch_tokens = 2 * one + 1
    sizes = []
    run = engine._run
    engine._run = lambda batch: (sizes.append(len(batch)), run(batch))[1]
    try:
        with Server(build_app(engine)) as s:
            engine.hold()
            out = []

            def post():
                with httpx.Client(base_url=s.url, timeout=60) as c:
                    body = {**TEXT, "n": 4, "max_tokens": 64 - len(tok.encode("1+1="))}
                    out.append(c.post("/v1/completions", json=body).status_code)

            threads = [threading.Thread(target=post) for _ in range(3)]
            for t in threads:
                t.start()
            assert _wait(lambda: engine.queued() >= 3, 30)
            engine.release()
            for t in threads:
                t.join(60)
        assert out == [200, 200, 200]
        assert sum(sizes) == 3 and max(sizes) <= 2, sizes
    finally:
        engine.close()


def engine_jobs(tok, n: int, span: int):
    """``n`` jobs of TEXT's prompt, each ``span`` tokens with its budget (the requests'
    cost, prefill included)."""
    from peergrade.serving.server import Job

    prompt = tok.encode(TEXT["prompt"], add_special_tokens=False)
    return [Job(prompt, span - len(prompt)) for _ in range(n)]


def test_the_default_budget_comes_from_the_memory(calc):
    from peergrade.serving.server import default_batch_tokens, kv_bytes_per_token

    model, _ = calc
    per = kv_bytes_per_token(model)  # 2 * 3 layers * 2 kv heads * 32 dims * 4 bytes
    assert per == 2 * 3 * 2 * 32 * 4
    assert default_batch_tokens(model, 512, memory_bytes=per * 100_000) == 100_000
    assert default_batch_tokens(model, 512, memory_bytes=per) >= 512  # one full context
    assert default_batch_tokens(model, 512) >= 512


# ----------------------------------------------------------------------------- keys


def test_an_api_key_is_required_on_the_api_routes(calc):
    model, tok = calc
    engine = Engine(model, tok, MODEL)
    try:
        with (
            Server(build_app(engine, api_key="sekrit")) as s,
            httpx.Client(base_url=s.url, timeout=30) as c,
        ):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
                for r in (
                    c.get("/v1/models", headers=headers),
                    c.post("/v1/completions", json=TEXT, headers=headers),
                    c.post("/inference/v1/generate", json={"token_ids": [1]}, headers=headers),
                ):
                    assert r.status_code == 401, r.text
                    assert r.json()["error"]["code"] == "invalid_api_key"
            ok = {"Authorization": "Bearer sekrit"}
            assert c.get("/v1/models", headers=ok).status_code == 200
            assert c.post("/v1/completions", json=TEXT, headers=ok).status_code == 200
            # the official client sends it as api_key
            openai = pytest.importorskip("openai")
            client = openai.OpenAI(base_url=s.url + "/v1", api_key="sekrit", max_retries=0)
            assert [m.id for m in client.models.list().data] == [MODEL]
    finally:
        engine.close()


@pytest.mark.parametrize(
    "host,key,warned",
    [
        ("0.0.0.0", None, True),
        ("192.168.1.5", None, True),
        ("0.0.0.0", "k", False),
        ("127.0.0.1", None, False),
        ("localhost", None, False),
        ("::1", None, False),
    ],
)
def test_binding_beyond_loopback_without_a_key_warns(calc, monkeypatch, capsys, host, key, warned):
    """Nothing is bound here: uvicorn's run is replaced, so the server never starts."""
    import uvicorn

    from peergrade.serving.server import Limits, serve

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **k: None)
    model, tok = calc
    with pytest.raises(SystemExit):
        serve(
            model,
            tok,
            MODEL,
            host=host,
            port=0,
            api_key=key,
            limits=Limits(max_batch_tokens=10_000),
        )
    assert ("without an API key" in capsys.readouterr().err) == warned


def test_the_api_key_comes_from_the_environment(monkeypatch):
    from peergrade.cli import build_parser

    monkeypatch.setenv("PEERGRADE_API_KEY", "from-env")
    args = build_parser().parse_args(["serve"])
    assert args.api_key == "from-env"
    args = build_parser().parse_args(["serve", "--api-key", "given"])
    assert args.api_key == "given"
