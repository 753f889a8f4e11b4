"""The OpenAI-compatible endpoint (``peergrade.serving.server``), through the official
``openai`` client against a server started in-process on a free port."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from peergrade.serving.server import Engine, Server, build_app  # noqa: E402

MODEL = "tiny"


@pytest.fixture(scope="module")
def calc():
    """The bundled tiny-calc model (it calls a calculator tool in the Hermes format)."""
    from peergrade.model.load import (
        load_model,
        load_tokenizer,
        prepare_tokenizer,
        resolve_model_path,
    )

    path = resolve_model_path("bundled:tiny-calc")
    return load_model(path).eval(), prepare_tokenizer(load_tokenizer(path))


@pytest.fixture(scope="module")
def server(calc):
    model, tok = calc
    engine = Engine(model, tok, MODEL, window_s=0.05)
    with Server(build_app(engine)) as s:
        s.engine = engine
        yield s
    engine.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)


QUESTION = [{"role": "user", "content": "1234*5678="}]


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_an_idle_connection_outlives_the_clients_pool_expiry(server):
    """A connection left idle longer than httpx's pool expiry (5 s, the openai client's) is
    still open: the client drops it first, so it never sends a request on a connection the
    server is closing (uvicorn's default, 5 s, raced it: a connection error)."""
    import socket

    request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        replies = []
        for wait in (0, 6):
            time.sleep(wait)
            sock.sendall(request)
            data = b""
            while b'"data"' not in data and (chunk := sock.recv(65536)):
                data += chunk
            replies.append(data)
    assert all(r.startswith(b"HTTP/1.1 200") and b'"data"' in r for r in replies), replies


def test_greedy_equals_hf_generate(client, calc):
    model, tok = calc
    r = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=24,
        extra_body={"return_token_ids": True},
    )
    body = r.model_dump()
    prompt = body["prompt_token_ids"]
    assert prompt == tok.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ids = body["choices"][0]["token_ids"]
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=24,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    assert ids == ref[0, len(prompt) :].tolist()[: len(ids)]
    assert len(ids) == len(ref[0]) - len(prompt)  # same end (eos or length)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ids)


def test_logprobs_are_the_model_s(client, calc):
    model, _ = calc
    r = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0.7,
        max_tokens=12,
        seed=3,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True},
    ).model_dump()
    ids, lps = r["choices"][0]["token_ids"], r["choices"][0]["logprobs"]["content"]
    assert len(lps) == len(ids) and all(len(x["top_logprobs"]) == 3 for x in lps)
    with torch.no_grad():
        x = torch.tensor([r["prompt_token_ids"] + ids])
        logits = model(input_ids=x).logits[0, len(r["prompt_token_ids"]) - 1 : -1].float() / 0.7
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor([x["logprob"] for x in lps]), ref, atol=1e-4)
    # the sampled token's log-prob is at most the best one's
    assert all(x["logprob"] <= x["top_logprobs"][0]["logprob"] + 1e-4 for x in lps)


def test_seed_reproducible_and_n(client):
    kw = dict(
        model=MODEL,
        messages=QUESTION,
        temperature=1.0,
        max_tokens=16,
        seed=11,
        n=3,
        extra_body={"return_token_ids": True},
    )
    a = client.chat.completions.create(**kw).model_dump()
    b = client.chat.completions.create(**kw).model_dump()
    assert len(a["choices"]) == 3
    assert [c["token_ids"] for c in a["choices"]] == [c["token_ids"] for c in b["choices"]]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "evaluate",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


def test_tool_calls_parsed(client):
    tools = TOOLS
    # the tiny-calc model calls the tool on some problems: sample until one does
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=tools, n=16, temperature=1.0, max_tokens=96, seed=0
    )
    called = [c for c in r.choices if c.finish_reason == "tool_calls"]
    assert called, [c.message.content for c in r.choices]
    call = called[0].message.tool_calls[0]
    assert call.function.name == "calculate"
    assert isinstance(json.loads(call.function.arguments), dict)
    assert "<tool_call>" not in (called[0].message.content or "")


FORCED = [
    ("required", '<tool_call>{"name": "'),
    (
        {"type": "function", "function": {"name": "calculate"}},
        '<tool_call>{"name": "calculate", "arguments": ',
    ),
]


@pytest.mark.parametrize("choice, prefix", FORCED)
def test_forced_tool_choice_starts_the_reply_with_a_call(client, calc, choice, prefix):
    """``tool_choice`` ``required`` (smolagents' ToolCallingAgent sends it) or a function by
    name: the reply starts with the chat template's own start of a call (read from the
    template: up to the name, or up to the named function's arguments), fed after the prompt,
    so greedy replies the unforced model answers in text are calls; streamed, the same call.
    Before, a 400."""
    tok = calc[1]
    kw = dict(
        model=MODEL,
        messages=QUESTION,
        tools=TOOLS,
        temperature=0,
        max_tokens=96,
        extra_body={"return_token_ids": True},
    )
    auto = client.chat.completions.create(**kw).model_dump()
    assert auto["choices"][0]["finish_reason"] != "tool_calls"  # unforced: no call here
    r = client.chat.completions.create(tool_choice=choice, **kw).model_dump()
    (c,) = r["choices"]
    assert c["finish_reason"] == "tool_calls", c["message"]
    (call,) = c["message"]["tool_calls"]
    assert call["function"]["name"] == "calculate" and json.loads(call["function"]["arguments"])
    fed = r["prompt_token_ids"][len(auto["prompt_token_ids"]) :]
    assert r["prompt_token_ids"][: len(auto["prompt_token_ids"])] == auto["prompt_token_ids"]
    assert tok.decode(fed) == prefix
    streamed = collect(client.chat.completions.create(stream=True, tool_choice=choice, **kw))
    assert streamed[0]["calls"][0]["name"] == "calculate"
    assert streamed[0]["calls"][0]["arguments"] == call["function"]["arguments"]
    assert streamed[0]["finish"] == "tool_calls"


def test_forced_tool_choice_needs_a_template_that_renders_calls(calc):
    """A template that does not render an assistant's tool calls as ``<tool_call>`` blocks
    cannot have a call forced: a 400 naming ``tool_choice``, not a reply that is no call."""
    model, tok = calc
    engine = Engine(
        model,
        tok,
        MODEL,
        chat_template="{% for m in messages %}{{ m.content }}"
        "{% endfor %}{% if add_generation_prompt %}A:{% endif %}",
    )
    with Server(build_app(engine)) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="-", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(
                model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required"
            )
    engine.close()
    assert e.value.body["param"] == "tool_choice" and "<tool_call>" in e.value.body["message"]


def test_stream(client):
    kw = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20)
    full = client.chat.completions.create(**kw).choices[0]
    pieces, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        ch = chunk.choices[0]
        pieces.append(ch.delta.content or "")
        finish = ch.finish_reason or finish
    assert "".join(pieces) == full.message.content
    assert finish == full.finish_reason
    assert sum(1 for p in pieces if p) > 1  # more than one chunk of content


def collect(stream) -> dict:
    """Per choice index: the content, tool calls, token ids and finish reason of a chat
    stream (the client's chunks added up)."""
    out: dict = {}
    for chunk in stream:
        body = chunk.model_dump()
        for ch in body["choices"]:
            c = out.setdefault(ch["index"], {"content": "", "calls": [], "ids": [], "finish": None})
            c["content"] += ch["delta"].get("content") or ""
            c["calls"] += [t["function"] for t in ch["delta"].get("tool_calls") or []]
            c["ids"] += ch.get("token_ids") or []
            c["finish"] = ch["finish_reason"] or c["finish"]
    return out


def test_stream_with_tools_and_n_adds_up_to_the_reply(client):
    """Content (with a tool call held back from its first character), tool calls, token ids
    and finish reasons of every choice of a live stream equal the same request unstreamed."""
    kw = dict(
        model=MODEL,
        messages=QUESTION,
        tools=TOOLS,
        n=16,
        temperature=1.0,
        max_tokens=96,
        seed=0,
        extra_body={"return_token_ids": True},
    )
    whole = client.chat.completions.create(**kw).model_dump()["choices"]
    got = collect(client.chat.completions.create(stream=True, **kw))
    assert sorted(got) == list(range(16))
    assert any(c["finish_reason"] == "tool_calls" for c in whole)  # the case that matters
    for c in whole:
        g = got[c["index"]]
        assert g["content"] == (c["message"]["content"] or "")
        assert g["ids"] == c["token_ids"] and g["finish"] == c["finish_reason"]
        assert [x["name"] for x in g["calls"]] == [
            t["function"]["name"] for t in c["message"]["tool_calls"] or []
        ]


def test_stream_is_sent_while_sampling(server, client):
    """The first content arrives before the reply is finished: the model's 4th forward pass
    waits until the client has content in hand (a stream sent at the end never lets it)."""
    got, waited, calls = threading.Event(), [], [0]

    def hook(module, args, kwargs):
        calls[0] += 1
        if calls[0] == 4:
            waited.append(got.wait(20))

    handle = server.engine.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        kw = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
        for chunk in client.chat.completions.create(stream=True, **kw):
            if chunk.choices[0].delta.content:
                got.set()
    finally:
        handle.remove()
    assert waited == [True]


def test_stream_that_fails_while_sampling_ends_with_an_error_event(server, client):
    """The stream has begun (HTTP 200) when the model fails: an error event in OpenAI's shape,
    which the client raises; the server goes on answering."""

    def hook(module, args, kwargs):
        raise RuntimeError("the device fell over")

    handle = server.engine.model.register_forward_pre_hook(hook, with_kwargs=True)
    kw = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=8)
    try:
        with pytest.raises(openai.APIError, match="the device fell over"):
            list(client.chat.completions.create(stream=True, **kw))
    finally:
        handle.remove()
    assert client.chat.completions.create(**kw).choices[0].finish_reason


@pytest.mark.parametrize("stop, echo", [(None, False), (["*"], True)])
def test_completion_streams(client, stop, echo):
    """A streamed completion (echo, a stop string held back) adds up to the unstreamed one."""
    kw = dict(
        model=MODEL,
        prompt="Q:12*34\nA:",
        max_tokens=12,
        temperature=0,
        stop=stop,
        echo=echo,
        extra_body={"return_token_ids": True},
    )
    whole = client.completions.create(**kw).model_dump()["choices"][0]
    text, ids, finish = "", [], None
    for chunk in client.completions.create(stream=True, **kw):
        ch = chunk.model_dump()["choices"][0]
        text, ids = text + ch["text"], ids + (ch.get("token_ids") or [])
        finish = ch["finish_reason"] or finish
    assert (text, ids, finish) == (whole["text"], whole["token_ids"], whole["finish_reason"])
    with_lp = list(client.completions.create(stream=True, logprobs=1, **kw))  # one whole chunk
    assert len(with_lp) == 1 and with_lp[0].choices[0].text == whole["text"]


def test_harmless_fields_tool_choice_none_and_stream_usage(client):
    """Fields set to what changes nothing are accepted; tool_choice 'none' is the request
    without tools; stream_options.include_usage ends the stream with the usage."""
    base = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    plain = client.chat.completions.create(**base).model_dump()
    same = client.chat.completions.create(
        tool_choice="auto",
        response_format={"type": "text"},
        frequency_penalty=0.0,
        presence_penalty=0,
        logit_bias={},
        parallel_tool_calls=False,
        **base,
    ).model_dump()
    assert same["choices"][0]["message"] == plain["choices"][0]["message"]
    none = client.chat.completions.create(tools=TOOLS, tool_choice="none", **base).model_dump()
    assert none["choices"][0]["message"] == plain["choices"][0]["message"]
    assert none["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]  # no tools shown
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **base)
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == plain["usage"]
    assert all(c.usage is None for c in chunks[:-1])
    cw = dict(model=MODEL, prompt="Q:1+2\nA:", max_tokens=6, temperature=0)
    done = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **cw)
    )
    assert done[-1].usage.total_tokens == client.completions.create(**cw).usage.total_tokens


def _generate(server, body):
    import httpx

    return httpx.post(server.url + "/inference/v1/generate", json=body, timeout=60)


def test_token_route_answers_as_vllm_does(server, client):
    """``/inference/v1/generate``: token ids in; the chat route's tokens and log-probs out, the
    tokens named ``token_id:<id>``; a stop token ends the reply there (itself kept)."""
    chat = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=24,
        logprobs=True,
        extra_body={"return_token_ids": True},
    ).model_dump()
    prompt, ids = chat["prompt_token_ids"], chat["choices"][0]["token_ids"]
    sp = {"max_tokens": 24, "temperature": 0, "logprobs": 1}
    r = _generate(server, {"model": MODEL, "token_ids": prompt, "sampling_params": sp}).json()
    (c,) = r["choices"]
    assert c["token_ids"] == ids and r["prompt_token_ids"] == prompt
    content = c["logprobs"]["content"]
    assert [x["token"] for x in content] == [f"token_id:{t}" for t in ids]
    want = [x["logprob"] for x in chat["choices"][0]["logprobs"]["content"]]
    assert torch.allclose(torch.tensor([x["logprob"] for x in content]), torch.tensor(want))
    assert all(len(x["top_logprobs"]) == 1 for x in content)
    assert r["usage"]["completion_tokens"] == len(ids)
    stop = ids[1]
    sp = {"max_tokens": 24, "temperature": 0, "stop_token_ids": [stop]}
    r = _generate(server, {"model": MODEL, "token_ids": prompt, "sampling_params": sp}).json()
    (c,) = r["choices"]
    assert c["token_ids"] == ids[: ids.index(stop) + 1] and c["finish_reason"] == "stop"
    assert c["logprobs"] is None
    r = _generate(server, {"model": MODEL, "token_ids": prompt}).json()  # vLLM's defaults
    assert len(r["choices"][0]["token_ids"]) <= 16


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "nope", "token_ids": [1]}, "model"),
        ({"model": MODEL}, "token_ids"),
        ({"model": MODEL, "token_ids": []}, "token_ids"),
        ({"model": MODEL, "token_ids": [10**9]}, "token_ids"),
        ({"model": MODEL, "token_ids": [True]}, "token_ids"),
        ({"model": MODEL, "token_ids": [1], "sampling_params": 3}, "sampling_params"),
        ({"model": MODEL, "token_ids": [1], "sampling_params": {"n": 0}}, "n"),
        (
            {"model": MODEL, "token_ids": [1], "sampling_params": {"stop_token_ids": [-1]}},
            "stop_token_ids",
        ),
        (
            {"model": MODEL, "token_ids": [1], "sampling_params": {"presence_penalty": 1.0}},
            "presence_penalty",
        ),
        ({"model": MODEL, "token_ids": [1], "sampling_params": {"ignore_eos": True}}, "ignore_eos"),
        ({"model": MODEL, "token_ids": [1], "features": {"mm_hashes": []}}, "features"),
        ({"model": MODEL, "token_ids": [1], "stream": True}, "stream"),
    ],
)
def test_token_route_bad_requests(server, body, param):
    r = _generate(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"


def test_renderers_client_generates_through_the_token_route(server, client):
    """verifiers' TrainClient path: ``renderers.client.generate`` renders the prompt itself,
    posts it to ``/inference/v1/generate`` and parses the reply; it gets the chat route's."""
    renderers = pytest.importorskip("renderers")
    from renderers.client import generate

    tok = server.engine.tokenizer
    renderer = renderers.create_renderer(tok, renderers.DefaultRendererConfig())
    chat = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=20,
        extra_body={"return_token_ids": True},
    ).model_dump()

    async def go():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
        return await generate(
            client=c,
            renderer=renderer,
            messages=QUESTION,
            model=MODEL,
            sampling_params={"max_tokens": 20, "temperature": 0.0},
        )

    out = asyncio.run(go())
    assert out["prompt_ids"] == chat["prompt_token_ids"]
    assert out["completion_ids"] == chat["choices"][0]["token_ids"]
    assert out["content"] == chat["choices"][0]["message"]["content"]
    assert len(out["completion_logprobs"]) == len(out["completion_ids"])


def test_sure_prefix():
    from peergrade.serving.stream import sure_prefix

    assert sure_prefix("hello wor", (), False) == "hello wor"
    assert sure_prefix("hello <tool_c", ("<tool_call>",), True) == "hello"
    assert sure_prefix(" hi <tool_call>{", ("<tool_call>",), True) == "hi"
    assert sure_prefix("a STO", ("STOP",), False) == "a "
    assert sure_prefix("a STOP b", ("STOP",), False) == "a "
    assert sure_prefix("caf\ufffd", (), False) == "caf"
    assert sure_prefix("x <", ("<tool_call>", "<<"), False) == "x "


def test_stop_and_completions(client, calc):
    _, tok = calc
    r = client.completions.create(
        model=MODEL,
        prompt="Q:12+34\nA:",
        max_tokens=8,
        temperature=0,
        logprobs=2,
        extra_body={"return_token_ids": True},
    )
    body = r.model_dump()
    assert body["prompt_token_ids"] == tok.encode("Q:12+34\nA:", add_special_tokens=False)
    assert len(body["choices"][0]["logprobs"]["token_logprobs"]) == len(
        body["choices"][0]["token_ids"]
    )
    text = body["choices"][0]["text"]
    if len(text) > 1:
        stop = text[1]
        s = client.completions.create(
            model=MODEL, prompt="Q:12+34\nA:", max_tokens=8, temperature=0, stop=[stop]
        )
        assert s.choices[0].text == text[: text.index(stop)]
        assert s.choices[0].finish_reason == "stop"


def _full_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 from one full forward (the reference)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(server, calc, max_tokens):
    """lm-eval's log-likelihood request (``local-completions``): token-id prompts, ``echo``,
    ``logprobs: 1``, ``max_tokens`` 1 (or 0, OpenAI's old way): the log-probs cover each
    prompt's tokens (the first ``None``), equal to a full forward's, and the top token says
    whether the continuation is greedy."""
    import httpx

    model, tok = calc
    ctx = tok.encode("Q:12+34\nA:", add_special_tokens=False)
    conts = [tok.encode(c, add_special_tokens=False) for c in ("46", "9x")]
    body = {
        "model": MODEL,
        "prompt": [ctx + c for c in conts],
        "temperature": 0,
        "max_tokens": max_tokens,
        "logprobs": 1,
        "echo": True,
        "seed": 1234,
    }
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    for choice, cont in zip(r["choices"], conts):
        ids = ctx + cont
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"][: len(ids)] == [tok.decode([t]) for t in ids]
        ref = _full_logprobs(model, ids)
        got = torch.tensor(lp["token_logprobs"][1 : len(ids)])
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
        # lm-eval: the continuation's log-likelihood and whether greedy would have written it
        with torch.no_grad():
            best = model(input_ids=torch.tensor([ids])).logits[0, :-1].argmax(-1).tolist()
        greedy = [tok.decode([t]) for t in best[len(ctx) - 1 :]]
        tops = [max(t, key=t.get) for t in lp["top_logprobs"][len(ctx) : len(ids)]]
        assert tops == greedy
        assert choice["text"].startswith(tok.decode(ids))
        assert (choice["text"] == tok.decode(ids)) == (max_tokens == 0)
    assert r["usage"]["completion_tokens"] == len(conts) * max_tokens


def _check_prompt_logprobs(got, model, ids: list[int], k: int) -> None:
    """vLLM's ``prompt_logprobs`` of ``ids``: None, then per token a dict by token id (the
    prompt's token first, then the ``k`` most likely) of log-prob, rank and decoded token,
    equal to one full forward's."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1)
    assert got[0] is None and len(got) == len(ids)
    for p, (d, t) in enumerate(zip(got[1:], ids[1:])):
        row = lp[p]
        first = next(iter(d))
        assert first == str(t)  # the prompt's own token first
        want = {t, *row.topk(k).indices.tolist()} if k else {t}
        assert {int(a) for a in d} == want
        for a, e in d.items():
            assert abs(e["logprob"] - row[int(a)].item()) < 1e-4
            assert e["rank"] == int((row > row[int(a)]).sum()) + 1
        assert d[str(t)]["decoded_token"]


def test_prompt_logprobs_on_every_route_as_vllm_gives_them(server, calc):
    """vLLM's ``prompt_logprobs`` extra: the chat route and the token route answer them at the
    top level, ``/v1/completions`` in each choice (every sample of a prompt the same); the
    numbers are the model's (temperature 1 whatever the sampling temperature), ranks as
    vLLM's. Before, the chat and text routes ignored the field and the token route refused it."""
    import httpx

    model, tok = calc

    def post(route, body):
        r = httpx.post(server.url + route, json={"model": MODEL, **body}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    r = post(
        "/v1/chat/completions",
        {
            "messages": QUESTION,
            "max_tokens": 2,
            "temperature": 0.5,
            "prompt_logprobs": 2,
            "return_token_ids": True,
        },
    )
    _check_prompt_logprobs(r["prompt_logprobs"], model, r["prompt_token_ids"], 2)
    ids = tok.encode("Q:12+34\nA:", add_special_tokens=False)
    r = post("/v1/completions", {"prompt": ids, "max_tokens": 2, "n": 2, "prompt_logprobs": 0})
    for c in r["choices"]:
        _check_prompt_logprobs(c["prompt_logprobs"], model, ids, 0)
    # with echo and logprobs too: each field has its own number of top tokens
    r = post(
        "/v1/completions",
        {
            "prompt": [ids, ids[:4]],
            "max_tokens": 1,
            "echo": True,
            "logprobs": 1,
            "prompt_logprobs": 3,
        },
    )
    for c, p in zip(r["choices"], [ids, ids[:4]]):
        _check_prompt_logprobs(c["prompt_logprobs"], model, p, 3)
        assert all(t is None or len(t) == 1 for t in c["logprobs"]["top_logprobs"])
    sp = {"max_tokens": 2, "prompt_logprobs": 1}
    r = post("/inference/v1/generate", {"token_ids": ids, "sampling_params": sp})
    _check_prompt_logprobs(r["prompt_logprobs"], model, ids, 1)
    r = post("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 2})
    assert "prompt_logprobs" not in r  # not asked: not computed


@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/chat/completions", {"messages": QUESTION, "prompt_logprobs": -1}),
        ("/v1/chat/completions", {"messages": QUESTION, "prompt_logprobs": 21}),
        ("/v1/chat/completions", {"messages": QUESTION, "prompt_logprobs": True}),
        ("/v1/chat/completions", {"messages": QUESTION, "prompt_logprobs": 1, "stream": True}),
        ("/v1/completions", {"prompt": "1+1=", "prompt_logprobs": "2"}),
        (
            "/inference/v1/generate",
            {"token_ids": [1, 2], "sampling_params": {"prompt_logprobs": -1}},
        ),
    ],
)
def test_prompt_logprobs_bad_requests(server, route, body):
    import httpx

    r = httpx.post(server.url + route, json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt_logprobs"
    assert "[0, 20]" in err["message"] or "with 'stream'" in err["message"]


def test_max_tokens_0_needs_echo(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Q:1+2\nA:", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    r = client.completions.create(model=MODEL, prompt="Q:1+2\nA:", max_tokens=0, echo=True)
    assert r.choices[0].text == "Q:1+2\nA:" and r.choices[0].logprobs is None
    s = client.completions.create(
        model=MODEL, prompt="Q:1+2\nA:", max_tokens=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in s if c.choices) == "Q:1+2\nA:"


def test_max_tokens_and_length(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=2,
        extra_body={"return_token_ids": True},
    )
    assert r.choices[0].finish_reason == "length"
    assert len(r.model_dump()["choices"][0]["token_ids"]) == 2


@pytest.mark.parametrize(
    "kwargs, code, param",
    [
        (dict(model="nope", messages=QUESTION), "model_not_found", "model"),
        (dict(model=MODEL, messages=[{"role": "wizard", "content": "x"}]), None, "messages"),
        (dict(model=MODEL, messages=[]), None, "messages"),
        (dict(model=MODEL, messages=[{"role": "user"}]), None, "messages"),
        (
            dict(model=MODEL, messages=[{"role": "user", "content": "x" * 600}]),
            "context_length_exceeded",
            "messages",
        ),
        (
            dict(model=MODEL, messages=[{"role": "user", "content": "hi"}] * 10_000),
            "context_length_exceeded",
            "messages",
        ),
        (
            dict(model=MODEL, messages=QUESTION, max_tokens=10_000),
            "context_length_exceeded",
            "messages",
        ),
        (dict(model=MODEL, messages=QUESTION, temperature=5), None, "temperature"),
        (dict(model=MODEL, messages=QUESTION, tools=[{"type": "function"}]), None, "tools"),
        (dict(model=MODEL, messages=QUESTION, tool_choice="required"), None, "tools"),
        (dict(model=MODEL, messages=QUESTION, tool_choice="any"), None, "tool_choice"),
        (
            dict(
                model=MODEL,
                messages=QUESTION,
                tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "nope"}},
            ),
            None,
            "tool_choice",
        ),
        # what this server cannot honour is refused, not ignored
        *[
            (dict(model=MODEL, messages=QUESTION, **{k: v}), "unsupported_parameter", k)
            for k, v in [
                ("response_format", {"type": "json_object"}),
                ("frequency_penalty", 0.5),
                ("logit_bias", {"5": 10}),
            ]
        ],
    ],
)
def test_errors_are_openai_shaped(client, kwargs, code, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kwargs)
    assert e.value.status_code == 400
    err = e.value.body
    assert isinstance(err.get("message"), str) and err["message"]
    assert err.get("type") == "invalid_request_error"
    assert err.get("param") == param
    if code:
        assert err.get("code") == code


def test_template_that_cannot_render_tools(calc):
    model, tok = calc
    engine = Engine(
        model,
        tok,
        MODEL,
        chat_template="{% for t in tools %}{{ t.missing.name() }}{% endfor %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}",
    )
    with Server(build_app(engine)) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="-", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(
                model=MODEL,
                messages=QUESTION,
                tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            )
        assert e.value.body["code"] == "template_error" and e.value.body["param"] == "tools"
    engine.close()


def test_tools_the_template_does_not_show_are_served_with_a_warning_once(calc, capfd):
    """tiny-calc's template renders no tool schemas (the model learned its call in a
    warm-up): ``peergrade serve`` answers, and says once per tool set that the model does not
    see them; a template that renders them says nothing."""
    from peergrade.model.tiny import TOOL_CHAT_TEMPLATE

    model, tok = calc
    warned = []
    for template in (None, TOOL_CHAT_TEMPLATE):
        engine = Engine(model, tok, MODEL, chat_template=template)
        with Server(build_app(engine)) as s:
            c = openai.OpenAI(base_url=s.url + "/v1", api_key="-", max_retries=0)
            for _ in range(2):
                r = c.chat.completions.create(
                    model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=1
                )
                assert r.choices[0].finish_reason == "length"
        engine.close()
        warned.append(capfd.readouterr().err)
    assert warned[0].count("does not render tool schemas") == 1, warned[0]
    assert "(calculate)" in warned[0] and "warm-up" in warned[0]
    assert "tool schemas" not in warned[1], warned[1]


def test_a_short_request_is_answered_while_a_longer_one_of_its_call_goes_on(calc):
    """Two plain requests in one ``generate`` call, one with a small ``max_tokens``: it is
    answered as soon as its row ends (the row leaves the batch at its budget), while the
    other is still sampled; each gets what it samples alone."""
    from peergrade.serving.server import Job

    model, tok = calc
    engine = Engine(model, tok, MODEL, window_s=1.0)
    engine.expected = lambda: 2  # the first call waits for both
    prompt = tok.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    drawn, at = [], {}
    short = Job(prompt, 2, key=1, stop_ids=())  # temperature 1 (the default)
    long = Job(prompt, 40, key=2, on_token=drawn.append)
    eos = set(engine.eos_ids)
    try:
        f_short, f_long = engine.submit([short]), engine.submit([long])
        f_short.add_done_callback(lambda f: at.setdefault("short", len(drawn)))
        (a,), (b,) = f_short.result(120), f_long.result(120)
        alone = [
            engine.submit([Job(prompt, j.max_tokens, key=j.key)]).result(120)[0]
            for j in (short, long)
        ]
    finally:
        engine.close()
    assert engine.calls == 3  # the two requests shared the first call
    assert len(a.token_ids) == 2 and a.finish == "length" and not eos & set(a.token_ids)
    assert len(b.token_ids) > 4  # the premise: the long one goes on
    assert at["short"] <= 3 < len(drawn)  # answered while the long one was sampled
    for got, ref in zip((a, b), alone):
        assert got.token_ids == ref.token_ids and got.finish == ref.finish
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(ref.logprobs))


def test_concurrent_requests_share_generate_calls(server):
    """16 concurrent clients are answered by fewer generate calls than requests, and each gets
    what it gets alone (draws keyed by its seed, not by its batch)."""
    kw = dict(model=MODEL, temperature=1.0, max_tokens=12, extra_body={"return_token_ids": True})

    async def run(ids):
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)

        async def one(i):
            r = await aclient.chat.completions.create(
                messages=[{"role": "user", "content": f"{100 + i}*{203 + i}="}], seed=i, **kw
            )
            return r.model_dump()["choices"][0]["token_ids"]

        return await asyncio.gather(*(one(i) for i in ids))

    import threading

    calls0, out = server.engine.calls, {}
    server.engine.hold()  # the 16 requests queue up, whatever the timing, then go together
    t = threading.Thread(target=lambda: out.setdefault("r", asyncio.run(run(range(16)))))
    t.start()
    while server.engine.queued() < 16:
        t.join(0.01)
    server.engine.release()
    t.join()
    together = out["r"]
    assert server.engine.calls - calls0 == 1
    alone = [asyncio.run(run([i]))[0] for i in (0, 7)]
    assert alone == [together[0], together[7]]


def test_a_prompt_is_rendered_once_for_the_requests_that_open_alike(server, monkeypatch):
    """The G samples of a prompt open with the same request: rendered once, the same ids."""
    from peergrade.serving import server as srv

    calls = []
    real = srv.render
    monkeypatch.setattr(srv, "render", lambda *a, **k: calls.append(1) or real(*a, **k))
    q = [{"role": "user", "content": "31*47= (a question of its own)"}]
    first = srv.render_prompt(server.engine, q, TOOLS)
    again = srv.render_prompt(server.engine, [dict(m) for m in q], TOOLS)
    assert (
        first == again == real(server.engine.tokenizer, q, add_generation_prompt=True, tools=TOOLS)
    )
    assert len(calls) == 1
    other = srv.render_prompt(server.engine, [{**q[0], "content": "31*48="}], TOOLS)
    assert len(calls) == 2 and other != first


def test_a_batch_of_prompts_is_numbered_prompt_by_prompt(client):
    """``prompt`` as a list: choice p * n + i is prompt p's i-th sample, each what the prompt
    alone gets (greedy), with its own prompt tokens; bad members are named."""
    prompts = ["Q:1+2\nA:", "Q:30+4\nA:", [53, 30, 23]]
    kw = dict(model=MODEL, max_tokens=6, temperature=0, extra_body={"return_token_ids": True})
    r = client.completions.create(prompt=prompts, n=2, **kw).model_dump()
    assert [c["index"] for c in r["choices"]] == list(range(6))
    alone = [client.completions.create(prompt=p, **kw).model_dump() for p in prompts]
    for c in r["choices"]:
        one = alone[c["index"] // 2]
        assert c["text"] == one["choices"][0]["text"]
        assert c["token_ids"] == one["choices"][0]["token_ids"]
        assert c["prompt_token_ids"] == one["prompt_token_ids"]
    assert r["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    chunks = list(client.completions.create(prompt=prompts[:2], stream=True, **kw))
    assert sorted(c.choices[0].index for c in chunks) == [0, 1]
    for bad in ([], ["ok", ""], ["ok", [1.5]], ["ok"] * 129):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=bad, max_tokens=2)
        assert e.value.body["param"] == "prompt"
