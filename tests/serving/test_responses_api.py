"""OpenAI's Responses API on the endpoint (``serving.responses``), through the official
``openai`` client: the same replies as the chat route, follow-ups by ``previous_response_id``
or by items, streams, refusals, and training episodes recorded as the chat requests they mean."""

# ruff: noqa: F811  (pytest fixtures imported from test_serve / test_harness, used as arguments)
from __future__ import annotations

import json

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

# the fixtures of the chat route's tests (server, client) and of the harness tests
from peergrade.serving.harness import HarnessRunner, harness_metrics  # noqa: E402
from test_envs import Steered, full_forward_logprobs  # noqa: E402
from test_harness import chat_loop, inner, merge_tok  # noqa: E402,F401
from test_harness import client as client_of  # noqa: E402
from test_serve import MODEL, QUESTION, calc, client, server  # noqa: E402,F401

TOOL = {
    "type": "function",
    "name": "calculate",
    "description": "evaluate",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}


def _called(client, seeds=range(24)):
    """A seed whose sampled reply (tiny-calc, temperature 1) calls the tool, and that reply."""
    for seed in seeds:
        r = client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            tools=[CHAT_TOOL],
            temperature=1.0,
            max_tokens=96,
            seed=seed,
        )
        if r.choices[0].finish_reason == "tool_calls":
            return seed, r
    pytest.fail("no seed of 24 made tiny-calc call the tool")


def test_a_response_is_the_chat_reply(client):
    """Text and function calls of a Responses reply equal the chat reply of the same request
    (same seed), and so do its token counts."""
    seed, chat = _called(client)
    r = client.responses.create(
        model=MODEL,
        input=QUESTION,
        tools=[TOOL],
        temperature=1.0,
        max_output_tokens=96,
        extra_body={"seed": seed},
    )
    msg = chat.choices[0].message
    assert r.status == "completed" and r.object == "response"
    assert r.output_text == (msg.content or "")
    calls = [o for o in r.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls
    ]
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    # plain text: a message item only; a cut reply is incomplete
    short = client.responses.create(model=MODEL, input="1+2=", max_output_tokens=2, temperature=0)
    assert [o.type for o in short.output] == ["message"]
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


def test_follow_ups_by_previous_id_and_by_items_are_the_same_conversation(client):
    """A tool result sent after ``previous_response_id`` and the same conversation re-sent
    as items render the same prompt (same length, same greedy reply), as does the chat
    request of those messages; with ``instructions`` a system message comes first."""
    seed, _ = _called(client)
    first = client.responses.create(
        model=MODEL,
        input=QUESTION,
        tools=[TOOL],
        temperature=1.0,
        max_output_tokens=96,
        extra_body={"seed": seed},
    )
    call = next(o for o in first.output if o.type == "function_call")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "7006652"}
    kw = dict(model=MODEL, tools=[TOOL], temperature=0, max_output_tokens=24)
    by_id = client.responses.create(
        previous_response_id=first.id, input=[result], instructions="Use the tool.", **kw
    )
    items = [*QUESTION, *[o.model_dump(exclude_none=True) for o in first.output], result]
    by_items = client.responses.create(input=items, instructions="Use the tool.", **kw)
    assert by_id.usage.input_tokens == by_items.usage.input_tokens
    assert by_id.output_text == by_items.output_text
    reply = {
        "role": "assistant",
        "content": first.output_text or None,
        "tool_calls": [
            {
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
        ],
    }
    messages = [
        {"role": "system", "content": "Use the tool."},
        *QUESTION,
        reply,
        {"role": "tool", "tool_call_id": call.call_id, "content": "7006652"},
    ]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[CHAT_TOOL], temperature=0, max_tokens=24
    )
    assert chat.usage.prompt_tokens == by_id.usage.input_tokens
    assert (chat.choices[0].message.content or "") == by_id.output_text
    # instructions are not carried over by previous_response_id
    bare = client.responses.create(input=items, **kw)
    assert bare.usage.input_tokens < by_items.usage.input_tokens


def test_a_streamed_response_adds_up_to_the_unstreamed_one(client):
    seed, _ = _called(client)
    kw = dict(
        model=MODEL,
        input=QUESTION,
        tools=[TOOL],
        temperature=1.0,
        max_output_tokens=96,
        extra_body={"seed": seed},
    )
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    done = [e.item for e in events if e.type == "response.output_item.done"]
    final = events[-1].response
    assert (
        [o.type for o in done] == [o.type for o in final.output] == [o.type for o in whole.output]
    )
    calls = lambda out: [(o.name, o.arguments) for o in out if o.type == "function_call"]  # noqa: E731
    assert calls(done) == calls(final.output) == calls(whole.output) != []
    assert final.usage.output_tokens == whole.usage.output_tokens
    # the stream helper of the client gets the same final response; it is stored too
    with client.responses.stream(**{**kw, "tools": [TOOL]}) as s:
        got = s.get_final_response()
    assert got.output_text == whole.output_text
    follow = client.responses.create(
        model=MODEL, previous_response_id=final.id, input="thanks", max_output_tokens=4
    )
    assert follow.usage.input_tokens > final.usage.input_tokens


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "calculate"}])
def test_forced_tool_choice_is_a_function_call(client, choice):
    """``tool_choice`` ``required`` or ``{"type": "function", "name": ...}`` (the Responses
    shape): the reply is a ``function_call`` item, as the chat route forces it."""
    r = client.responses.create(
        model=MODEL,
        input="1234*5678=",
        tools=[TOOL],
        tool_choice=choice,
        temperature=0,
        max_output_tokens=96,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "calculate" and json.loads(calls[0].arguments)


@pytest.mark.parametrize(
    "kwargs, status, param",
    [
        (dict(previous_response_id="resp_nope", input="x"), 404, "previous_response_id"),
        (dict(input=[]), 400, "input"),
        (
            dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]),
            400,
            "input",
        ),
        (dict(input=[{"type": "file_search_call", "id": "x"}]), 400, "input"),
        (dict(input="x", tools=[{"type": "web_search"}]), 400, "tools"),
        (
            dict(input="x", tool_choice={"type": "function", "name": "nope"}, tools=[TOOL]),
            400,
            "tool_choice",
        ),
        (dict(input="x", text={"format": {"type": "json_object"}}), 400, "text.format"),
        (dict(input="x", background=True), 400, "background"),
        (dict(input="x", max_output_tokens=10**7), 400, "input"),
        (dict(input=[{"type": "function_call", "name": "f"}]), 400, "input"),
    ],
)
def test_bad_responses_requests(client, kwargs, status, param):
    with pytest.raises(openai.APIStatusError) as e:
        client.responses.create(model=MODEL, **kwargs)
    assert e.value.status_code == status
    assert e.value.body.get("param") == param and e.value.body.get("message")


def test_unstored_responses_cannot_be_continued(client):
    r = client.responses.create(model=MODEL, input="1+1=", max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, previous_response_id=r.id, input="and?")


def test_stored_responses_are_retrieved_and_deleted(client):
    """GET /v1/responses/{id} returns a stored response as it was sent (a streamed one too);
    DELETE forgets it: retrieving, deleting or continuing it again is a 404, as is an unstored
    response."""
    r = client.responses.create(model=MODEL, input="1+1=", max_output_tokens=4)
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    with client.responses.stream(model=MODEL, input="2+2=", max_output_tokens=4) as s:
        streamed = s.get_final_response()
    got = client.responses.retrieve(streamed.id)  # (the stream helper adds 'parsed' fields)
    assert (got.status, got.output_text, got.usage) == (
        streamed.status,
        streamed.output_text,
        streamed.usage,
    )
    assert [o.id for o in got.output] == [o.id for o in streamed.output]
    client.responses.delete(r.id)
    for again in (
        lambda: client.responses.retrieve(r.id),
        lambda: client.responses.delete(r.id),
        lambda: client.responses.create(model=MODEL, previous_response_id=r.id, input="and?"),
    ):
        with pytest.raises(openai.NotFoundError):
            again()
    assert client.responses.retrieve(streamed.id).id == streamed.id  # the other is kept
    unstored = client.responses.create(model=MODEL, input="1+1=", max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_an_episode_retrieves_and_deletes_its_own_responses(inner, merge_tok, client):
    """Under an episode's base URL, its own responses are retrieved and deleted; a response
    of the plain route is not one of them."""
    outside = client.responses.create(model=MODEL, input="1+1=", max_output_tokens=3)
    seen = {}

    def harness(row, base_url, model):
        c = client_of(base_url)
        r = c.responses.create(model=model, input=row["q"], max_output_tokens=4)
        seen["same"] = c.responses.retrieve(r.id).output_text == r.output_text
        c.responses.delete(r.id)
        for rid in (r.id, outside.id):
            try:
                c.responses.retrieve(rid)
                seen[rid] = "found"
            except openai.NotFoundError:
                seen[rid] = "404"
        return 1.0

    runner = HarnessRunner(inner, merge_tok)
    try:
        (res,) = runner.run(harness, [{"q": "hi"}], n=1, max_completion_length=20, seed=1)
    finally:
        runner.close()
    assert res.error is None and seen.pop("same") is True
    assert set(seen.values()) == {"404"} and len(seen) == 2


def responses_loop(turns: int, follow_up: str = "go on", by_id: bool = True, stream=False):
    """``chat_loop`` written against the Responses API: each follow-up continues the last
    response by ``previous_response_id`` (or re-sends every item)."""

    def harness(row, base_url, model):
        c = client_of(base_url)
        items, prev = [{"role": "user", "content": row["q"]}], None
        new = list(items)
        for _ in range(turns):
            kw = dict(model=model, temperature=0.3, max_output_tokens=7)
            if stream:
                with c.responses.stream(
                    input=new if by_id else items, previous_response_id=prev, **kw
                ) as s:
                    r = s.get_final_response()
            else:
                r = c.responses.create(
                    input=new if by_id else items, previous_response_id=prev, **kw
                )
            items += [o.model_dump(exclude_none=True) for o in r.output]
            new = [{"role": "user", "content": follow_up}]
            items += new
            prev = r.id if by_id else None
        return 1.0

    return harness


@pytest.mark.parametrize("by_id, stream", [(True, False), (False, False), (True, True)])
def test_responses_requests_are_recorded_as_the_chat_requests(inner, merge_tok, by_id, stream):
    """A training episode driven through /responses records exactly the tokens, mask and
    log-probs of the same conversation sent as chat requests (0 splits)."""
    model = Steered(inner, merge_tok.eos_token_id, eos_every=5, eos_bias=6.0)
    runs = {}
    for name, fn in [
        ("responses", responses_loop(3, by_id=by_id, stream=stream)),
        ("chat", chat_loop(3)),
    ]:
        runner = HarnessRunner(model, merge_tok)
        try:
            runs[name] = runner.run(
                fn,
                [{"q": "hi"}, {"q": "ab"}],
                n=2,
                max_completion_length=120,
                temperature=1.0,
                seed=5,
                max_tokens_per_turn=12,
            )
        finally:
            runner.close()
    got, ref = runs["responses"], runs["chat"]
    assert [r.error for r in got] == [None] * 4
    assert harness_metrics(got)["harness/split_episodes"] == 0.0
    eps = [r.episode for r in got]
    assert [e.input_ids for e in eps] == [r.episode.input_ids for r in ref]
    assert [e.loss_mask for e in eps] == [r.episode.loss_mask for r in ref]
    assert all(e.num_turns == 3 for e in eps)
    logp, b = full_forward_logprobs(model.eval(), eps, merge_tok.pad_token_id, 1.0)
    torch.testing.assert_close(logp * b["loss_mask"], b["logprobs"], atol=1e-5, rtol=0)


def test_both_ways_of_following_up_mean_the_same_chat_messages():
    """Unit level: a follow-up by ``previous_response_id`` and the same conversation sent as
    items translate to the same chat messages (a tool result named after its call both ways;
    the reply's text and calls one assistant message)."""
    from peergrade.serving.responses import Request, ResponseStore

    store = ResponseStore()
    first = Request({"model": "m", "input": "q", "tools": [TOOL]}, store)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "calculate", "arguments": '{"expression": "a*b"}'},
    }
    reply = {"role": "assistant", "content": "let me", "tool_calls": [call]}
    out = first.response(reply, "tool_calls", None)["output"]
    first.keep(store, reply, {})
    result = {"type": "function_call_output", "call_id": "call_1", "output": "42"}
    by_id = Request({"model": "m", "previous_response_id": first.rid, "input": [result]}, store)
    by_items = Request(
        {"model": "m", "input": [{"role": "user", "content": "q"}, *out, result]}, store
    )
    assert (
        by_id.chat["messages"]
        == by_items.chat["messages"]
        == [
            {"role": "user", "content": "q"},
            reply,
            {"role": "tool", "tool_call_id": "call_1", "content": "42", "name": "calculate"},
        ]
    )
    assert [o["type"] for o in out] == ["message", "function_call"]
