"""Episodes recorded from an external agent through the endpoint (``serving.recorder`` and
``serving.harness``): token-exact records, the in-process engine's record, failures."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from peergrade.envs.template import render, turn_delta  # noqa: E402
from peergrade.generation.episodes import run_episodes  # noqa: E402
from peergrade.generation.record import SamplerSettings  # noqa: E402
from peergrade.model.tiny import TOOL_CHAT_TEMPLATE, build_char_tokenizer, build_tiny_model  # noqa: E402
from peergrade.serving.harness import HarnessRunner, harness_metrics  # noqa: E402
from test_envs import Fixed, Steered, forced_model, full_forward_logprobs  # noqa: E402

GREEDY = SamplerSettings(n=1, max_new_tokens=1, temperature=0.0)  # a Job's sampling


@pytest.fixture(scope="module")
def merge_tok():
    # "ab" is one token of this tokenizer: a model that samples "a", "b" separately (or "ab"
    # where text is cut after "a") holds tokens that re-encoding the text would not give
    return build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE, merges=(("a", "b"),))


@pytest.fixture(scope="module")
def inner(merge_tok):
    model, _ = build_tiny_model("qwen2", merge_tok, seed=0, max_position_embeddings=2048)
    return model.eval()


def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="-", max_retries=0)


def chat_loop(turns: int, follow_up: str = "go on"):
    """A harness: its own loop over the openai client, echoing each reply back."""

    def harness(row, base_url, model):
        c = client(base_url)
        messages = [{"role": "user", "content": row["q"]}]
        for _ in range(turns):
            r = c.chat.completions.create(
                model=model, messages=messages, temperature=0.3, max_tokens=7
            )  # the trainer's settings win
            messages.append(r.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "user", "content": follow_up})
        return 1.0

    return harness


def test_recorded_episodes_are_token_exact(inner, merge_tok):
    """Sampled at temperature 1 with eos nudged every few positions: several turns per
    episode; the recorded log-probs equal one full forward over the final sequences."""
    model = Steered(inner, merge_tok.eos_token_id, eos_every=5, eos_bias=6.0)
    runner = HarnessRunner(model, merge_tok)
    try:
        rows = [{"q": "hi"}, {"q": "tell me more"}]
        res = runner.run(
            chat_loop(3),
            rows,
            n=2,
            max_completion_length=120,
            temperature=1.0,
            seed=5,
            max_tokens_per_turn=12,
        )
    finally:
        runner.close()
    assert [r.error for r in res] == [None] * 4
    eps = [r.episode for r in res]
    assert all(e.num_turns >= 2 for e in eps)
    assert any(0 in e.loss_mask for e in eps)  # template/user tokens in between, masked out
    for e, row_index in zip(eps, (0, 0, 1, 1)):
        assert e.row_index == row_index
        assert e.prompt_ids == render(
            merge_tok,
            [{"role": "user", "content": rows[row_index]["q"]}],
            add_generation_prompt=True,
        )
    logp, b = full_forward_logprobs(model.eval(), eps, merge_tok.pad_token_id, 1.0)
    torch.testing.assert_close(logp * b["loss_mask"], b["logprobs"], atol=1e-5, rtol=0)
    assert harness_metrics(res)["harness/split_episodes"] == 0.0


def test_kept_kv_cache_feeds_only_new_tokens_and_samples_the_same(inner, merge_tok):
    """Each episode's KV cache is kept between its requests: later turns feed only the last
    sampled token and the template delta, and the episodes are those of re-prefilling the whole
    history every turn (the same keyed draws)."""
    out = {}
    for keep in (True, False):
        model = Steered(inner, merge_tok.eos_token_id, eos_every=5, eos_bias=6.0)
        runner = HarnessRunner(model, merge_tok, keep_cache=keep)
        try:
            res = runner.run(
                chat_loop(3),
                [{"q": "hi"}, {"q": "tell me more"}],
                n=2,
                max_completion_length=120,
                temperature=1.0,
                seed=5,
                max_tokens_per_turn=12,
            )
        finally:
            runner.close()
        out[keep] = ([r.episode.input_ids for r in res], sum(model.widths))
    assert out[True][0] == out[False][0]
    assert out[True][1] < out[False][1] * 0.7  # tokens fed through the model


def test_episodes_that_open_alike_share_one_prefill_and_sample_the_same(inner, merge_tok):
    """New episodes whose first request is the same prompt (a row's G samples) prefill it
    once, the row copied to the others, as the in-process engine does; every episode samples
    what it samples alone (the draws are keyed per episode)."""
    from peergrade.generation.sessions import Sessions
    from peergrade.serving.server import Job

    a = merge_tok("what is two plus two")["input_ids"]
    b = merge_tok("name a colour")["input_ids"]
    eos = [merge_tok.eos_token_id]
    jobs = [
        Job(a, 6, session="s0", key=0),
        Job(b, 6, session="s1", key=1),
        Job(a, 6, session="s2", key=2),
        Job(a, 6, session="s3", key=3),
    ]
    together = Sessions(inner, merge_tok, eos, 2048)
    fed = []
    feed = together.eng._feed
    together.eng._feed = lambda pending: fed.append(pending) or feed(pending)
    shared = together.run(jobs)
    assert sorted(map(len, fed[0])) == sorted([len(a), len(b)])  # 2 rows, not 3 x a + b
    assert all(len(p) == 4 for p in fed[1:])  # then one row each
    # two more opening alike while those four are open: a call of their own rows only, the
    # prompt fed once
    late = [Job(b, 6, session="s4", key=4), Job(b, 6, session="s5", key=5)]
    fed.clear()
    shared += together.run(late)
    assert fed[0] == [b] and all(len(p) == 2 for p in fed[1:])
    for job, got in zip(jobs + late, shared):
        (alone,) = Sessions(inner, merge_tok, eos, 2048).run([job])
        assert got[0] == alone[0]  # the same tokens
        torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(alone[1]), atol=1e-5, rtol=0)
    assert shared[0][0] != shared[2][0] or shared[0][0] != shared[3][0]  # own draws each


def test_a_call_runs_only_its_own_episodes_rows(inner, merge_tok):
    """A call whose jobs are some of the open episodes feeds a batch of just those rows (the
    others cost nothing); new episodes beside held ones that open alike still prefill their
    prompt once; every job samples what it samples alone (keyed draws)."""
    from peergrade.generation.sessions import Sessions
    from peergrade.serving.server import Job

    eos = [merge_tok.eos_token_id]
    prompts = [merge_tok(q)["input_ids"] for q in ("hi", "name a colour", "two plus two", "ok")]
    first = [Job(p, 5, session=f"s{i}", key=i) for i, p in enumerate(prompts)]
    s = Sessions(inner, merge_tok, eos, 2048)
    fed = []
    feed = s.eng._feed
    s.eng._feed = lambda pending: fed.append(pending) or feed(pending)
    got = s.run(first)
    assert {len(p) for p in fed[1:]} == {4}
    # the next turn of episodes 1 and 3 only, and two new episodes opening alike
    more = merge_tok(" go on")["input_ids"]
    later = [Job(first[i].prompt_ids + got[i][0] + more, 6, session=f"s{i}", key=i) for i in (1, 3)]
    later += [Job(prompts[0], 6, session=f"n{k}", key=10 + k) for k in range(2)]
    fed.clear()
    out = s.run(later)
    assert all(len(p) == 4 for p in fed)  # 4 rows, not the 6 open episodes
    # held rows feed their last sampled token and the delta; one new row feeds the prompt
    assert [len(p) for p in fed[0][:2]] == [1 + len(more)] * 2
    assert sorted(map(len, fed[0][2:])) == [0, 2]
    assert set(s.seen) == {f"s{i}" for i in range(4)} | {"n0", "n1"}
    for job, res in zip(later, out):
        (alone,) = Sessions(inner, merge_tok, eos, 2048).run([job])
        assert res[0] == alone[0] and res[3] == alone[3]
        torch.testing.assert_close(torch.tensor(res[1]), torch.tensor(alone[1]), atol=1e-5, rtol=0)
    # the kept rows hold exactly their tokens: a third turn of episode 1 still matches alone
    j = later[0]
    third = Job(j.prompt_ids + out[0][0] + more, 6, session="s1", key=1)
    fed.clear()
    (res,) = s.run([third])
    assert len(fed[0]) == 1
    (alone,) = Sessions(inner, merge_tok, eos, 2048).run([third])
    assert res[0] == alone[0]
    torch.testing.assert_close(torch.tensor(res[1]), torch.tensor(alone[1]), atol=1e-5, rtol=0)


def test_a_turn_that_ends_is_answered_while_longer_turns_go_on(inner, merge_tok):
    """In one call of several episodes' turns, a turn that ends (here at a smaller budget) is
    answered at once, while the longer turn is still sampled, so its agent can work meanwhile;
    its follow-up, sent then, waits for the next call and still feeds only its new tokens (the
    episode's cache was kept when the first call ended). Each reply is what its job samples
    alone."""
    from peergrade.generation.sessions import Sessions
    from peergrade.serving.server import Engine, Job

    engine = Engine(inner, merge_tok, "m", window_s=1.0)
    engine.keep_sessions()
    engine.expected = lambda: 2  # the first call waits for both episodes' turns
    fed, at, later = [], {}, {}
    feed = engine.sessions.eng._feed
    engine.sessions.eng._feed = lambda pending: fed.append(pending) or feed(pending)
    more = merge_tok(" go on")["input_ids"]
    short = Job(merge_tok("hi")["input_ids"], 2, sampling=GREEDY, session="a", key=1)
    long = Job(merge_tok("name a colour")["input_ids"], 14, sampling=GREEDY, session="b", key=2)

    def answered(name):
        def cb(fut):
            at[name] = len(fed)  # forward passes made when this reply was handed over
            if name == "short":  # its agent asks its next turn at once
                ids = short.prompt_ids + fut.result()[0].token_ids + more
                later["job"] = Job(ids, 3, sampling=GREEDY, session="a", key=1)
                later["fut"] = engine.submit([later["job"]])

        return cb

    try:
        f_short, f_long = engine.submit([short]), engine.submit([long])
        f_short.add_done_callback(answered("short"))
        f_long.add_done_callback(answered("long"))
        (a,), (b,) = f_short.result(120), f_long.result(120)
        (c,) = later["fut"].result(120)
    finally:
        engine.close()
    assert len(a.token_ids) == 2 and len(b.token_ids) > 4  # the test's premise
    assert at["short"] < at["long"] - 2  # answered while the long turn went on
    assert [len(p) for p in fed[at["long"]]] == [1 + len(more)]  # the follow-up: kept cache
    for job, got in ((short, a), (long, b), (later["job"], c)):
        (alone,) = Sessions(inner, merge_tok, [merge_tok.eos_token_id], 2048).run([job])
        assert got.token_ids == alone[0] and got.finish == alone[3]


def test_a_call_that_fails_after_an_early_answer(inner, merge_tok):
    """A call that fails after one of its turns was answered: the answer stands, the other
    request gets the error, and the answered episode's follow-up (its kept cache lost with the
    call) is sampled afresh in the next call, as it samples alone."""
    from peergrade.generation.sessions import Sessions
    from peergrade.serving.server import Engine, Job

    engine = Engine(inner, merge_tok, "m", window_s=1.0)
    engine.keep_sessions()
    engine.expected = lambda: 2
    fed = []
    feed = engine.sessions.eng._feed

    def failing(pending):
        fed.append(pending)
        if len(fed) == 6:  # the short turn (2 tokens) has ended by then
            raise RuntimeError("device lost")
        return feed(pending)

    engine.sessions.eng._feed = failing
    short = Job(merge_tok("hi")["input_ids"], 2, sampling=GREEDY, session="a", key=1)
    long = Job(merge_tok("name a colour")["input_ids"], 14, sampling=GREEDY, session="b", key=2)
    try:
        f_short, f_long = engine.submit([short]), engine.submit([long])
        (a,) = f_short.result(120)
        with pytest.raises(RuntimeError, match="device lost"):
            f_long.result(120)
        engine.expected = lambda: 1
        ids = short.prompt_ids + a.token_ids + merge_tok(" go on")["input_ids"]
        follow = Job(ids, 4, sampling=GREEDY, session="a", key=1)
        before = len(fed)
        (c,) = engine.submit([follow]).result(120)
    finally:
        engine.close()
    assert len(a.token_ids) == 2
    assert max(map(len, fed[before])) == len(ids)  # the whole history fed again
    (alone,) = Sessions(inner, merge_tok, [merge_tok.eos_token_id], 2048).run([follow])
    assert c.token_ids == alone[0]


def test_slab_cache_of_rows_and_back():
    """kernel.slab_cache_of right-aligns rows of different lengths (an empty one too) with zero
    hole columns before them; slab_rows reads each row's real columns back unchanged."""
    from peergrade.generation.kernel import slab_cache_of, slab_rows

    torch.manual_seed(0)
    rows = [[(torch.randn(2, n, 3), torch.randn(2, n, 5)) for _ in range(3)] for n in (4, 1)]
    cache, width = slab_cache_of(rows[:1] + [None] + rows[1:], capacity=6, grow=True)
    assert width == 4 and all(layer.length == 4 for layer in cache.layers)
    keys = cache.layers[2].keys[:, :, :4]
    assert keys[1].abs().sum() == 0 and keys[2, :, :3].abs().sum() == 0  # holes are zeros
    real = torch.tensor([[True] * 4, [False] * 4, [False] * 3 + [True]])
    back = slab_rows(cache, real)
    assert back[1][0][0].shape == (2, 0, 3)
    for got, want in zip([back[0], back[2]], rows):
        for (k, v), (k0, v0) in zip(got, want):
            assert torch.equal(k, k0) and torch.equal(v, v0)


def test_sampled_turns_are_never_retokenised(inner, merge_tok):
    """The model samples "x", "a", "b": re-rendering the history from text would hold the
    merged token "ab". The record is prompt + sampled ids + the template's delta, exactly what
    the in-process engine records for the same model and conversation."""
    tok = merge_tok
    row = {"q": "say ab"}
    prompt = render(tok, [{"role": "user", "content": "say ab"}], add_generation_prompt=True)
    chars = lambda text: [tok.encode(c, add_special_tokens=False)[0] for c in text]  # noqa: E731
    eos = tok.eos_token_id
    turn1 = chars("xab") + [eos]
    history = [{"role": "user", "content": "say ab"}, {"role": "assistant", "content": "xab"}]
    delta = turn_delta(tok, history, [{"role": "user", "content": "go on"}], eos_ids=[eos])
    turn2 = chars("ab") + [eos]
    seq = prompt + turn1 + delta + turn2
    p1, p2 = len(prompt), len(prompt) + len(turn1) + len(delta)
    model = forced_model(inner, tok, seq, [*range(p1, p1 + len(turn1)), *range(p2, len(seq))])
    runner = HarnessRunner(model, tok)
    try:
        (r,) = runner.run(chat_loop(2), [row], n=1, max_completion_length=200, temperature=1.0)
    finally:
        runner.close()
    (ref,) = run_episodes(
        model,
        tok,
        [row],
        lambda _: Fixed(),
        max_completion_length=200,
        max_turns=2,
        temperature=1.0,
        seed=0,
    )
    e = r.episode
    assert e.input_ids == seq == ref.input_ids
    assert e.loss_mask == ref.loss_mask
    torch.testing.assert_close(
        torch.tensor(e.logprobs), torch.tensor(ref.logprobs), atol=1e-5, rtol=0
    )
    ab = tok.convert_tokens_to_ids("ab")
    assert ab not in e.completion_ids  # a server that re-rendered history would hold it
    assert render(tok, history, add_generation_prompt=False)[p1 : p1 + 2] == [
        tok.convert_tokens_to_ids("x"),
        ab,
    ]  # (what re-rendering gives: the test can fail)


def test_a_bpe_merge_across_a_turn_boundary_is_kept(inner, merge_tok):
    """With the trainer's stop string "a", the turn ends inside the sampled token "ab": the
    client sees "go " (the stop string left out, as OpenAI does) and the record keeps "ab",
    then the template's end-of-turn token, masked out: the in-process engine's record."""
    tok = merge_tok
    row, eos = {"q": "q"}, tok.eos_token_id
    chars = lambda text: [tok.encode(c, add_special_tokens=False)[0] for c in text]  # noqa: E731
    prompt = render(tok, [{"role": "user", "content": "q"}], add_generation_prompt=True)
    turn1 = chars("go ") + [tok.convert_tokens_to_ids("ab")]
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "go a"}]
    delta = turn_delta(
        tok, history, [{"role": "user", "content": "go on"}], eos_ids=[eos], close_turn=True
    )
    turn2 = chars("ok") + [eos]
    seq = prompt + turn1 + delta + turn2
    first = len(prompt)
    sampled = [*range(first, first + len(turn1)), *range(len(seq) - len(turn2), len(seq))]
    model = forced_model(inner, tok, seq, sampled)
    seen = []

    def harness(row, base_url, model_name):
        c = client(base_url)
        messages = [{"role": "user", "content": "q"}]
        for _ in range(2):
            r = c.chat.completions.create(model=model_name, messages=messages)
            seen.append(r.choices[0].message.content)
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": "go on"},
            ]
        return {"reward": 0.5, "turns": 2}

    runner = HarnessRunner(model, tok)
    try:
        (r,) = runner.run(
            harness,
            [row],
            n=1,
            max_completion_length=200,
            temperature=0.0,
            stop=["a"],
            max_tokens_per_turn=12,
        )
    finally:
        runner.close()
    (ref,) = run_episodes(
        model,
        tok,
        [row],
        lambda _: Fixed(),
        max_completion_length=200,
        max_turns=2,
        max_tokens_per_turn=12,
        temperature=0.0,
        stop=["a"],
    )
    e = r.episode
    assert seen[0] == "go "
    assert e.input_ids == seq == ref.input_ids and e.loss_mask == ref.loss_mask
    assert r.reward == 0.5 and r.metrics == {"turns": 2.0}
    logp, b = full_forward_logprobs(model.eval(), [e], tok.pad_token_id, 0.0)
    torch.testing.assert_close(logp * b["loss_mask"], b["logprobs"], atol=1e-5, rtol=0)


def test_a_changed_history_splits_the_episode(inner, merge_tok):
    model = Steered(inner, merge_tok.eos_token_id, eos_every=4, eos_bias=8.0)

    def harness(row, base_url, model_name):
        c = client(base_url)
        m = [{"role": "user", "content": "q"}]
        c.chat.completions.create(model=model_name, messages=m)
        # the client rewrites the model's reply before going on: not the recorded tokens
        m += [{"role": "assistant", "content": "something else"}, {"role": "user", "content": "?"}]
        c.chat.completions.create(model=model_name, messages=m)
        return 1

    runner = HarnessRunner(model, merge_tok)
    try:
        (r,) = runner.run(
            harness,
            [{"q": "q"}],
            n=1,
            max_completion_length=60,
            temperature=1.0,
            max_tokens_per_turn=8,
        )
    finally:
        runner.close()
    assert r.error is None and r.splits == 1 and r.requests == 2
    # the last segment: its prompt is the rewritten history, rendered
    assert r.episode.num_prompt_messages == 3
    assert harness_metrics([r])["harness/split_episodes"] == 1.0


def test_an_episode_s_url_refuses_another_episode_s_agent(inner, merge_tok):
    """An agent that learns another open episode's id posts to that episode's URL without
    its key (or with its own key): a 404 in OpenAI's error shape, and the other episode's
    record is unchanged (one request, no split, the same tokens)."""
    import threading

    import httpx

    model = Steered(inner, merge_tok.eos_token_id, eos_every=4, eos_bias=8.0)
    runner = HarnessRunner(model, merge_tok)
    victim_asked, attacked = threading.Event(), threading.Event()
    seen: dict = {}

    def eid_key(base_url):  # the path after /episodes/: the id, then (if any) the key
        return base_url.split("/episodes/")[1].split("/")

    def harness(row, base_url, model_name):
        m = [{"role": "user", "content": row["q"]}]
        if row["q"] == "victim":
            r = client(base_url).chat.completions.create(model=model_name, messages=m)
            seen["victim_reply"] = r.choices[0].message.content
            seen["victim_tokens"] = r.usage.completion_tokens
            victim_asked.set()
            assert attacked.wait(60), "the other agent never came"
            return 1
        assert victim_asked.wait(60), "the victim never asked"
        own = eid_key(base_url)
        (other,) = [r for r in list(runner.recorder._by_id.values()) if r.eid != own[0]]
        body = {"model": model_name, "messages": m + [{"role": "user", "content": "mine now"}]}
        own_key = own[1] if len(own) > 1 else "x"
        for name, suffix in (("no key", ""), ("own key", f"/{own_key}"), ("bad", "/wrong")):
            at = f"{runner.url}/v1/episodes/{other.eid}{suffix}"
            got = httpx.post(f"{at}/chat/completions", json=body, timeout=60)
            models = httpx.get(f"{at}/models", timeout=60)
            seen[name] = (got.status_code, got.json(), models.status_code)
        attacked.set()
        client(base_url).chat.completions.create(model=model_name, messages=m)
        return 1

    try:
        victim, attacker = runner.run(
            harness,
            [{"q": "victim"}, {"q": "attacker"}],
            n=1,
            max_completion_length=60,
            temperature=1.0,
            max_tokens_per_turn=8,
        )
    finally:
        attacked.set()
        runner.close()
    assert victim.error is None and attacker.error is None, (victim.error, attacker.error)
    for name in ("no key", "own key", "bad"):
        status, answer, models = seen[name]
        assert status in (403, 404) and models in (403, 404), (name, status, answer, models)
        assert set(answer["error"]) >= {"message", "type", "code"}, (name, answer)
    # the victim's record holds its own one request and reply, nothing of the other agent's
    assert (victim.requests, victim.splits) == (1, 0)
    assert victim.episode.messages[0] == {"role": "user", "content": "victim"}
    assert victim.episode.loss_mask.count(1) == seen["victim_tokens"]
    assert attacker.requests == 1 and attacker.splits == 0


def one_episode(runner, harness, **kw):
    """The one episode of ``harness`` on row ``{"q": "q"}`` (then the runner is closed)."""
    kw = {"max_completion_length": 60, "temperature": 1.0, **kw}
    try:
        (r,) = runner.run(harness, [{"q": "q"}], n=1, **kw)
    finally:
        runner.close()
    return r


def test_a_retried_request_gets_the_recorded_answer_and_does_not_split(inner, merge_tok):
    """The openai client gives up waiting (its timeout) and sends the same request again,
    marked as a retry: the retry waits for the first attempt, gets the answer recorded for it,
    and nothing is sampled twice, so the episode's next request extends it (no split)."""
    model = Steered(inner, merge_tok.eos_token_id, eos_every=4, eos_bias=8.0)
    runner = HarnessRunner(model, merge_tok)
    arrived, replies = [], []
    one_at_a_time = runner.recorder._one_at_a_time

    async def counting(rec, request, key, retry):
        arrived.append(retry)
        return await one_at_a_time(rec, request, key, retry)

    runner.recorder._one_at_a_time = counting

    def harness(row, base_url, model_name):
        impatient = openai.OpenAI(base_url=base_url, api_key="-", max_retries=5, timeout=1.0)
        m = [{"role": "user", "content": "q"}]
        r = impatient.chat.completions.create(model=model_name, messages=m)
        replies.append(r.choices[0].message.content)
        m += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "?"}]
        client(base_url).chat.completions.create(model=model_name, messages=m)
        return 1

    def release_after_a_retry():
        deadline = time.monotonic() + 60
        while len(arrived) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        runner.engine.release()

    import threading

    runner.engine.hold()  # the first attempt waits until the client has timed out and retried
    threading.Thread(target=release_after_a_retry, daemon=True).start()
    r = one_episode(runner, harness, max_tokens_per_turn=8)
    assert arrived[:2] == [False, True]  # the premise: a timed-out request, then its retry
    assert r.error is None and r.splits == 0 and r.retries >= 1
    assert r.episode.num_turns == 2 and r.requests == 2  # each turn sampled once
    first = r.episode.completion_ids[: r.episode.loss_mask.index(0)]
    assert replies == [merge_tok.decode(first, skip_special_tokens=True)]
    assert harness_metrics([r])["harness/retried_requests"] == r.retries


def test_only_a_marked_retry_of_the_last_request_is_answered_again(inner, merge_tok):
    """Sent with the openai client's retry header, the last request's exact body (a stream
    too) gets its recorded answer; without the header, or with another body, it is a request
    of its own (sampled: the same history again is a split)."""
    import httpx

    model = Steered(inner, merge_tok.eos_token_id, eos_every=4, eos_bias=8.0)
    runner = HarnessRunner(model, merge_tok)
    got = {}

    def harness(row, base_url, model_name):
        url = base_url + "/chat/completions"
        body = {"model": model_name, "messages": [{"role": "user", "content": "q"}]}
        retry = {"x-stainless-retry-count": "1"}
        with httpx.Client(timeout=60) as h:
            got["first"] = h.post(url, json=body).json()
            got["again"] = h.post(url, json=body, headers=retry).json()
            other = {**body, "max_tokens": 3}  # another body: not a retry of the last one
            got["other"] = h.post(url, json=other, headers=retry).json()
            streamed = {**body, "stream": True}
            got["stream"] = h.post(url, json=streamed).text
            got["stream_again"] = h.post(url, json=streamed, headers=retry).text
            got["fresh"] = h.post(url, json=streamed).text  # no header: sampled again
        return 1

    r = one_episode(runner, harness, max_tokens_per_turn=8)
    assert r.error is None and r.retries == 2 and r.requests == 4
    assert got["again"] == got["first"] and "choices" in got["first"]
    assert got["other"]["id"] != got["first"]["id"]
    assert got["stream_again"] == got["stream"] and "data: [DONE]" in got["stream"]
    assert got["fresh"] != got["stream"]
    assert r.splits == 3  # the same history sent again as a request of its own: a split


def test_an_episode_s_reply_carries_the_top_logprobs_asked_for(inner, merge_tok):
    """``logprobs`` / ``top_logprobs`` in an episode's request: each token's log-prob is the
    recorded one, with the ``top_logprobs`` most likely tokens (under the trainer's
    temperature), the sampled token's log-prob among them or below the last."""
    got = {}

    def harness(row, base_url, model_name):
        r = client(base_url).chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "q"}],
            max_tokens=5,
            logprobs=True,
            top_logprobs=3,
        )
        got["lp"] = r.choices[0].logprobs.content
        return 1

    r = one_episode(HarnessRunner(inner, merge_tok), harness)
    assert r.error is None and len(got["lp"]) == len(r.episode.completion_ids) > 0
    for item, recorded in zip(got["lp"], r.episode.logprobs):
        assert abs(item.logprob - recorded) < 1e-5
        tops = [t.logprob for t in item.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        by_token = {t.token: t.logprob for t in item.top_logprobs}
        if item.token in by_token:
            assert abs(by_token[item.token] - item.logprob) < 1e-5
        else:
            assert item.logprob <= tops[-1] + 1e-5


def test_an_episode_s_prompt_logprobs_score_its_recorded_tokens(inner, merge_tok):
    """vLLM's ``prompt_logprobs`` in an episode's second chat request: the
    episode's tokens so far (the first prompt, the sampled turn as sampled, the template
    delta), each with its log-prob under the model, as one full forward gives them."""
    got = {}

    def harness(row, base_url, model_name):
        c = client(base_url)
        msgs = [{"role": "user", "content": "q"}]
        r = c.chat.completions.create(model=model_name, messages=msgs, max_tokens=5)
        msgs += [
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "ab"},
        ]
        got["chat"] = c.chat.completions.create(
            model=model_name,
            messages=msgs,
            max_tokens=3,
            extra_body={"prompt_logprobs": 1, "return_token_ids": True},
        ).model_dump()
        return 1

    r = one_episode(HarnessRunner(inner, merge_tok), harness)
    assert r.error is None and r.splits == 0
    ep, reply = r.episode, got["chat"]
    seq = reply["prompt_token_ids"]
    assert seq == (ep.prompt_ids + ep.completion_ids)[: len(seq)]  # the recorded tokens
    with torch.no_grad():
        lp = torch.log_softmax(inner(input_ids=torch.tensor([seq])).logits[0, :-1].float(), -1)
    scored = reply["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(seq)
    for p, (d, t) in enumerate(zip(scored[1:], seq[1:])):
        assert abs(d[str(t)]["logprob"] - lp[p, t].item()) < 1e-4
        assert len(d) in (1, 2) and str(lp[p].argmax().item()) in d


TAG_TEMPLATE = (  # a template variable ("tag") that shows in every user turn
    "{% for m in messages %}{% if m['role'] == 'user' %}<|im_start|>user\n"
    "{% if tag is defined %}[{{ tag }}]{% endif %}{{ m['content'] }}<|im_end|>\n"
    "{% else %}<|im_start|>assistant\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chat_template_kwargs_render_an_episode_and_a_plain_request(inner):
    """vLLM's ``chat_template_kwargs`` (template variables, e.g. Qwen3's ``enable_thinking``):
    the plain route renders the prompt with them, and an episode renders its prompt and each
    template delta with them; other variables on a later request would render the history
    differently, so the episode splits there. Before, they were ignored."""
    tok = build_char_tokenizer(chat_template=TAG_TEMPLATE, merges=(("a", "b"),))
    q = [{"role": "user", "content": "q"}]
    kw = {"tag": "ab"}
    got = {}

    def harness(row, base_url, model_name):
        c, msgs = client(base_url), list(q)
        for turn in range(2):
            r = c.chat.completions.create(
                model=model_name,
                messages=msgs,
                max_tokens=4,
                extra_body={"chat_template_kwargs": kw, "return_token_ids": True},
            ).model_dump()
            got[turn] = (r["prompt_token_ids"], r["choices"][0]["token_ids"])
            msgs += [
                {"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"more {turn}"},
            ]
        c.chat.completions.create(
            model=model_name,
            messages=msgs,
            max_tokens=2,
            extra_body={"chat_template_kwargs": {"tag": "x"}},
        )
        got["plain"] = (
            openai.OpenAI(base_url=base_url.split("/v1/")[0] + "/v1", api_key="-", max_retries=0)
            .chat.completions.create(
                model=model_name,
                messages=q,
                max_tokens=1,
                extra_body={"chat_template_kwargs": kw, "return_token_ids": True},
            )
            .model_dump()["prompt_token_ids"]
        )
        return 1

    r = one_episode(HarnessRunner(inner, tok), harness, max_tokens_per_turn=4)
    assert r.error is None and r.requests == 3
    with_kw = render(tok, q, add_generation_prompt=True, template_kwargs=kw)
    assert tok.decode(with_kw) == "<|im_start|>user\n[ab]q<|im_end|>\n<|im_start|>assistant\n"
    assert got["plain"] == with_kw and got[0][0] == with_kw
    (first, sampled), (second, _) = got[0], got[1]
    assert second[: len(first) + len(sampled)] == first + sampled  # the turn as sampled
    delta = tok.decode(second[len(first) + len(sampled) :])
    assert delta.endswith("<|im_start|>user\n[ab]more 0<|im_end|>\n<|im_start|>assistant\n")
    assert r.splits == 1  # the third request's other variables


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"chat_template_kwargs": "tag"}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
        ({"min_p": 0.1}, "min_p"),
        ({"ignore_eos": True}, "ignore_eos"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ({"structured_outputs": {"json": {}}}, "structured_outputs"),
        ({"best_of": 3}, "best_of"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
    ],
)
def test_vllm_extras_that_cannot_be_honoured_are_refused(inner, merge_tok, extra, param):
    """vLLM's extra fields this server cannot honour get a 400 naming them on the plain route
    (before, they were ignored: a reply the client did not ask for); harmless values pass.
    A training episode ignores the sampling ones (the trainer's sampling wins) and refuses
    the rendering ones as the plain route does."""
    import httpx

    runner = HarnessRunner(inner, merge_tok)
    try:
        body = {
            "model": runner.name,
            "messages": [{"role": "user", "content": "q"}],
            "max_tokens": 2,
        }
        r = httpx.post(runner.url + "/v1/chat/completions", json={**body, **extra}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
        harmless = {
            "min_p": 0,
            "ignore_eos": False,
            "best_of": 1,
            "chat_template_kwargs": {},
            "continue_final_message": False,
            "add_generation_prompt": True,
        }
        r = httpx.post(runner.url + "/v1/chat/completions", json={**body, **harmless}, timeout=60)
        assert r.status_code == 200, r.text
    except BaseException:
        runner.close()
        raise
    got = {}

    def harness(row, base_url, model_name):
        got["r"] = httpx.post(base_url + "/chat/completions", json={**body, **extra}, timeout=60)
        return 1

    one_episode(runner, harness)
    sampling = param not in (
        "chat_template_kwargs",
        "continue_final_message",
        "add_generation_prompt",
    )
    assert got["r"].status_code == (200 if sampling else 400), got["r"].text


def test_a_forced_tool_choice_in_an_episode_feeds_the_call_s_start_unmasked_out(inner, merge_tok):
    """``tool_choice: required`` in an episode (smolagents' ToolCallingAgent sends it): the
    template's start of a call is appended after the prompt with loss mask 0 (fed, not
    sampled), the model samples the rest of the turn; the reply carries it, the agent's next
    request matches the record (no split), and the log-probs are one full forward's."""
    model = Steered(inner, merge_tok.eos_token_id, eos_every=5, eos_bias=8.0)
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    msgs = [{"role": "user", "content": "q"}]
    got = {}

    def harness(row, base_url, model_name):
        c, m = client(base_url), list(msgs)
        for _ in range(2):
            r = c.chat.completions.create(
                model=model_name, messages=m, tools=tools, tool_choice="required", max_tokens=6
            )
            got.setdefault("content", []).append(r.choices[0].message.content)
            m += [
                r.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "again"},
            ]
        return 1

    r = one_episode(
        HarnessRunner(model, merge_tok), harness, max_tokens_per_turn=6, max_completion_length=300
    )
    assert r.error is None and r.splits == 0 and r.requests == 2
    e = r.episode
    prefix = "<tool_call>\n" + '{"name": "'
    fed = merge_tok.encode(prefix, add_special_tokens=False)
    prompt = render(merge_tok, msgs, add_generation_prompt=True, tools=tools)
    assert e.prompt_ids == prompt
    assert e.completion_ids[: len(fed)] == fed and e.loss_mask[: len(fed)] == [0] * len(fed)
    assert e.loss_mask[len(fed)] == 1  # then the model's own tokens
    assert all(c.startswith(prefix) for c in got["content"]), got  # its text starts the call
    assert e.completion_ids.count(fed[0]) >= 2  # the second turn was forced too
    logp, b = full_forward_logprobs(model.eval(), [e], merge_tok.pad_token_id, 1.0)
    torch.testing.assert_close(logp * b["loss_mask"], b["logprobs"], atol=1e-5, rtol=0)


def test_tool_choice_none_in_an_episode_renders_no_tools_as_the_plain_route(inner, merge_tok):
    """``tool_choice: none`` with tools: the episode's prompt is rendered without them, as
    ``/v1/chat/completions`` renders that request (the model is not offered a tool)."""
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    msgs = [{"role": "user", "content": "q"}]

    def harness(row, base_url, model_name):
        client(base_url).chat.completions.create(
            model=model_name, messages=msgs, tools=tools, tool_choice=row["choice"], max_tokens=3
        )
        return 1

    runner = HarnessRunner(inner, merge_tok)
    try:
        none, auto = runner.run(
            harness, [{"choice": "none"}, {"choice": "auto"}], n=1, max_completion_length=20
        )
    finally:
        runner.close()
    assert none.episode.prompt_ids == render(merge_tok, msgs, add_generation_prompt=True)
    assert auto.episode.prompt_ids == render(
        merge_tok, msgs, add_generation_prompt=True, tools=tools
    )
    assert none.episode.prompt_ids != auto.episode.prompt_ids


def test_tools_the_template_does_not_show_fail_a_training_episode_unless_allowed(inner):
    """A harness sending tools to a policy whose chat template renders none: the episode
    fails with a 400 that says why and names env.unrendered_tools, which lets it through."""
    from peergrade.model.tiny import CHAT_TEMPLATE

    tok = build_char_tokenizer(chat_template=CHAT_TEMPLATE)  # no tool schemas rendered
    model, _ = build_tiny_model("qwen2", tok, seed=0)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]

    def with_tools(row, base_url, model_name):
        client(base_url).chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "q"}], tools=tools
        )
        return 1.0

    rows = [{"q": "q", "prompt": [{"role": "user", "content": "q"}]}]
    for allowed in (False, True):
        runner = HarnessRunner(model.eval(), tok, unrendered_tools=allowed)
        try:
            (res,) = runner.run(with_tools, rows, n=1, max_completion_length=8)
        finally:
            runner.close()
        if allowed:
            assert res.error is None and res.reward == 1.0, res.error
        else:
            assert res.error and "does not render tool schemas" in res.error, res.error
            assert "(lookup)" in res.error and "env.unrendered_tools" in res.error


def test_failing_harnesses_score_zero_and_the_rest_run(inner, merge_tok):
    model = Steered(inner, merge_tok.eos_token_id, eos_every=4, eos_bias=8.0)

    def good(row, base_url, model_name):
        client(base_url).chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "q"}]
        )
        return 1.0

    def raises(row, base_url, model_name):
        good(row, base_url, model_name)
        raise ValueError("boom")

    def hangs(row, base_url, model_name):
        time.sleep(30)  # abandoned on its daemon thread

    async def hangs_async(row, base_url, model_name):
        await asyncio.sleep(30)  # cancelled

    def returns_text(row, base_url, model_name):
        good(row, base_url, model_name)
        return "1.0"

    def never_calls(row, base_url, model_name):
        return 1.0

    def other_episode(row, base_url, model_name):
        other = base_url.rsplit("/", 1)[0] + "/not-an-episode"
        with pytest.raises(openai.NotFoundError):
            client(other).chat.completions.create(
                model=model_name, messages=[{"role": "user", "content": "q"}]
            )
        # a client sending 10k messages: a clear 400
        with pytest.raises(openai.BadRequestError, match="context"):
            client(base_url).chat.completions.create(
                model=model_name, messages=[{"role": "user", "content": "hi"}] * 10_000
            )
        return good(row, base_url, model_name)

    cases = {
        "good": good,
        "raises": raises,
        "returns_text": returns_text,
        "never_calls": never_calls,
        "other_episode": other_episode,
    }
    rows = [{"q": "q", "case": k, "prompt": [{"role": "user", "content": "q"}]} for k in cases]
    runner = HarnessRunner(model, merge_tok)
    try:
        res = runner.run(
            lambda row, u, m: cases[row["case"]](row, u, m),
            rows,
            n=1,
            max_completion_length=40,
            max_tokens_per_turn=6,
        )
        # 30 s of sleep against a 1 s limit: abandoned (sync) or cancelled (async)
        hang_res = runner.run(hangs, rows[:1], n=1, max_completion_length=40, timeout_s=1.0)
        hang_res += runner.run(hangs_async, rows[:1], n=1, max_completion_length=40, timeout_s=1.0)
    finally:
        runner.close()
    by = {row["case"]: r for row, r in zip(rows, res)}
    assert by["good"].error is None and by["good"].reward == 1.0
    assert by["other_episode"].error is None and by["other_episode"].reward == 1.0
    assert by["raises"].kind == "exception" and "boom" in by["raises"].error
    assert by["raises"].reward == 0.0 and by["raises"].episode.num_turns == 1
    assert [r.kind for r in hang_res] == ["timeout", "timeout"]
    assert [r.reward for r in hang_res] == [0.0, 0.0]
    assert by["returns_text"].kind == "bad_return" and "str" in by["returns_text"].error
    assert by["never_calls"].kind == "no_request" and by["never_calls"].reward == 0.0
    assert by["never_calls"].episode.prompt_ids  # a record the update can hold (nothing trained)
    assert sum(by["never_calls"].episode.loss_mask) == 0
    m = harness_metrics(res + hang_res)
    assert m["harness/failed"] == 5 / 7 and m["harness/failed_timeout"] == 2 / 7


def test_grpo_trainer_takes_a_harness(tmp_path):
    """``GRPOTrainer(harness=fn)``: no reward_funcs needed; one step trains on the recorded
    episodes, the harness's reward is the mix."""
    from peergrade import GRPOTrainer
    from peergrade.api import GRPOConfig

    calls = []

    async def harness(row, base_url, model):  # an async harness, with the async client
        c = openai.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0)
        r = await c.chat.completions.create(model=model, messages=row["prompt"], max_tokens=8)
        calls.append(r.choices[0].message.content)
        return {"reward": float(len(calls) % 2), "answer_len": len(r.choices[0].message.content)}

    rows = [
        {"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
        for a, b in [(12, 7), (23, 41)]
    ]
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=1,
        max_completion_length=16,
        gradient_checkpointing=False,
    )
    trainer = GRPOTrainer("bundled:tiny-calc", None, args, rows, harness=harness)
    assert [s.name for s in trainer._run.rewards] == ["harness"]
    trainer.train()
    assert len(calls) >= 4  # every (prompt, sample) of the step (and the held-out passes)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    m = next(json.loads(x) for x in lines if "loss/policy" in x)
    assert m["harness/failed"] == 0.0 and "harness/answer_len" in m


def test_peergrade_eval_of_a_harness_run_runs_its_harness(tmp_path, capsys):
    """``peergrade eval --model RUN`` of a run trained through a harness evaluates with the
    harness, as the run's held-out table did, so the numbers are the table's (it used to score
    the model's plain replies); ``--harness.fn null`` evaluates the model alone."""
    from pathlib import Path

    from peergrade.cli.evaluate import run_eval_command
    from peergrade.config import load_config
    from peergrade.training.trainer import train

    example = Path(__file__).resolve().parents[2] / "examples" / "openai_agent" / "config.yaml"
    small = [
        ("train.steps", 1),
        ("train.eval_size", 6),
        ("train.eval_samples", 2),
        ("rollout.prompts_per_step", 2),
        ("rollout.group_size", 2),
        ("harness.processes", 0),
        ("harness.concurrency", None),
    ]
    cfg = load_config(str(example), small)
    summary = train(cfg, tmp_path / "run")
    run = str(tmp_path / "run")
    out = run_eval_command(model=run, overrides=[("harness.processes", 0)])
    assert out["harness"] == cfg.harness.fn
    assert out["scorer"] == "harness"  # what the agent returned: the run's training reward
    after = summary["eval_after"]
    for key in ("pass@1_greedy", "pass@1_sampled", "tool_call_rate", "tool_call_rate_sampled"):
        assert out[key] == after[key], key
    alone = run_eval_command(model=run, overrides=[("harness.fn", None)])
    assert "harness" not in alone and "tool_call_rate" not in alone  # plain replies
    assert alone["scorer"] == "arithmetic"  # the task's verifier scores the model alone
    from peergrade.cli import main

    capsys.readouterr()
    assert main(["eval", "--model", run, "--harness.processes", "0"]) == 0
    text = capsys.readouterr().out
    assert f"answers: episodes of the harness {cfg.harness.fn} (harness.fn)" in text
    assert f"pass@1_greedy        {after['pass@1_greedy']:.3f}" in text
    assert f"tool_call_rate       {after['tool_call_rate']:.3f}" in text  # the agent's calls


# ------------------------------------------------------------------ harness.processes: workers

AGENTS = "tests/harness_agents.py"  # what the workers load by name (no torch, no pytest)


def _by_name(name):
    from peergrade.envs.harness_pool import HarnessPool
    from peergrade.envs.load import load_object

    return load_object(f"{AGENTS}:{name}", "harness.fn"), HarnessPool


def test_worker_processes_record_the_same_episodes(inner, merge_tok):
    """The sampling is keyed per episode: the same episodes (tokens, masks, rewards, the
    harness's numbers) whether the harness runs on threads or in 2 worker processes."""
    fn, HarnessPool = _by_name("chat")
    rows = [{"q": "hi"}, {"q": "tell me more"}, {"q": "and?"}]
    out = {}
    for processes in (0, 2):
        model = Steered(inner, merge_tok.eos_token_id, eos_every=5, eos_bias=6.0)
        runner = HarnessRunner(model, merge_tok)
        pool = HarnessPool(f"{AGENTS}:chat", processes) if processes else None
        try:
            out[processes] = runner.run(
                fn,
                rows,
                n=3,
                max_completion_length=60,
                temperature=1.0,
                seed=7,
                max_tokens_per_turn=12,
                pool=pool,
            )
        finally:
            runner.close()
            if pool is not None:
                workers = list(pool.workers)
                pool.close()
                assert workers and all(not w.proc.is_alive() for w in workers)
    a, b = out[0], out[2]
    assert [r.error for r in a] == [r.error for r in b] == [None] * 9
    assert [r.episode.input_ids for r in a] == [r.episode.input_ids for r in b]
    assert [r.episode.loss_mask for r in a] == [r.episode.loss_mask for r in b]
    assert [r.reward for r in a] == [r.reward for r in b]
    assert [r.metrics for r in a] == [r.metrics for r in b]
    assert len({r.reward for r in a}) > 1  # the rewards depend on what was sampled
    for x, y in zip(a, b):
        torch.testing.assert_close(
            torch.tensor(x.episode.logprobs), torch.tensor(y.episode.logprobs), atol=1e-5, rtol=0
        )


def test_failures_in_a_worker_keep_their_kinds_and_texts(inner, merge_tok):
    """Raised, bad return, never called, overran: the same (kind, error, reward) as on
    threads; a sys.exit() is that episode's failure ("called sys.exit(3)"), not the end of the
    trainer, as on threads."""
    fn, HarnessPool = _by_name("by_case")
    cases = ["good", "raises", "returns_text", "never_calls", "hangs"]
    rows = [{"case": c, "prompt": [{"role": "user", "content": "q"}]} for c in cases]
    model = Steered(inner, merge_tok.eos_token_id, eos_every=4, eos_bias=8.0)
    runner = HarnessRunner(model, merge_tok)
    pool = HarnessPool(f"{AGENTS}:by_case", 2)
    seen = {}
    try:
        for p in (None, pool):  # warm-up: the workers' first client (lazy imports) is slow
            runner.run(fn, rows[:1] * 2, n=1, max_completion_length=8, pool=p)
        for mode, p in (("threads", None), ("processes", pool)):
            res = runner.run(
                fn,
                rows,
                n=1,
                max_completion_length=40,
                max_tokens_per_turn=6,
                timeout_s=6.0,
                pool=p,
            )
            seen[mode] = [(r.kind, r.error, r.reward) for r in res]
            for p_ in (None, pool):
                (out,) = runner.run(fn, [{"case": "exits"}], n=1, max_completion_length=8, pool=p_)
                assert (out.kind, out.error, out.reward) == ("exception", "called sys.exit(3)", 0.0)
    finally:
        runner.close()
        pool.close()
    assert seen["threads"] == seen["processes"]
    assert [k for k, _, _ in seen["processes"]] == [
        None,
        "exception",
        "bad_return",
        "no_request",
        "timeout",
    ]
    assert seen["processes"][1][1] == "ValueError: boom"


def test_a_dying_worker_fails_its_episodes_and_is_replaced(inner, merge_tok):
    """A worker that exits (os._exit, a segfault): its episodes fail with one clear error
    naming the process and its exit code, nothing hangs, and the next run has a new worker."""
    fn, HarnessPool = _by_name("by_case")
    model = Steered(inner, merge_tok.eos_token_id, eos_every=4, eos_bias=8.0)
    runner = HarnessRunner(model, merge_tok)
    pool = HarnessPool(f"{AGENTS}:by_case", 1)
    rows = [{"case": c, "prompt": "q"} for c in ("good", "dies", "good")]
    try:
        t0 = time.monotonic()
        res = runner.run(fn, rows, n=1, max_completion_length=20, timeout_s=60, pool=pool)
        assert time.monotonic() - t0 < 30
        first = pool.workers[0].proc.pid
        again = runner.run(fn, rows[:1], n=1, max_completion_length=20, pool=pool)
        assert pool.workers[0].proc.pid != first
    finally:
        runner.close()
        pool.close()
    dead = res[1]
    assert dead.kind == "exception" and dead.reward == 0.0
    assert "worker process" in dead.error and "exit code 7" in dead.error
    assert all(r.error in (None, dead.error) for r in res)
    assert again[0].error is None and again[0].reward == 1.0


def test_a_worker_left_with_only_abandoned_calls_is_replaced(inner, merge_tok):
    """A harness that hangs holding a core (a busy loop) times out and scores 0; its thread
    cannot be stopped, so the next run replaces the worker it spins in (the process is gone),
    and the episodes go on in the new one."""
    fn, HarnessPool = _by_name("by_case")
    model = Steered(inner, merge_tok.eos_token_id, eos_every=4, eos_bias=8.0)
    runner = HarnessRunner(model, merge_tok)
    pool = HarnessPool(f"{AGENTS}:by_case", 1)
    rows = [{"case": c, "prompt": "q"} for c in ("spins", "good")]
    try:
        # alone: an episode beside it in that worker would share its GIL with the spinning loop
        res = runner.run(fn, rows[:1], n=1, max_completion_length=20, timeout_s=2, pool=pool)
        first = pool.workers[0].proc
        assert first.is_alive()  # the spinning call still runs there
        again = runner.run(fn, rows[1:], n=1, max_completion_length=20, pool=pool)
        assert pool.workers[0].proc.pid != first.pid and not first.is_alive()
        kept = pool.workers[0].proc.pid
        later = runner.run(fn, rows[1:], n=1, max_completion_length=20, pool=pool)
        assert pool.workers[0].proc.pid == kept  # a worker with nothing left running is kept
    finally:
        runner.close()
        pool.close()
    assert res[0].kind == "timeout" and res[0].reward == 0.0
    assert again[0].error is None and again[0].reward == 1.0 and later[0].error is None


def test_a_worker_that_cannot_load_the_harness_says_so():
    from peergrade.envs.harness_pool import HarnessPool, WorkerStartError

    pool = HarnessPool(f"{AGENTS}:no_such_agent", 1)
    try:
        with pytest.raises(WorkerStartError, match="no_such_agent"):
            pool.ensure()
    finally:
        pool.close()


def test_harness_processes_config_and_python_errors(tmp_path):
    from peergrade import GRPOTrainer
    from peergrade.api import GRPOConfig
    from peergrade.config import ConfigError, load_config
    from peergrade.errors import InputError

    with pytest.raises(ConfigError) as e:
        load_config(None, [("harness.fn", f"{AGENTS}:chat"), ("harness.processes", -1)])
    assert "harness.processes" in str(e.value) and "\n" not in str(e.value)
    assert load_config(None, []).harness.processes == "auto"
    from peergrade.config import PYTHON_ONLY
    from peergrade.training.harness import processes_of

    chat = _by_name("chat")[0]
    assert processes_of(f"{AGENTS}:chat", "auto", chat) == min(4, os.cpu_count() or 1)
    assert processes_of(PYTHON_ONLY + "chat", "auto", chat) == 0  # GRPOTrainer(harness=fn)
    assert processes_of(f"{AGENTS}:async_chat", "auto", _by_name("async_chat")[0]) == 0
    assert processes_of(f"{AGENTS}:chat", 3, chat) == 3
    os.environ["LOCAL_WORLD_SIZE"] = "64"  # torchrun's: 64 ranks on this machine
    try:
        assert processes_of(f"{AGENTS}:chat", "auto", chat) == 1
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]

    def local_agent(row, base_url, model):  # not importable by name
        return 1.0

    rows = [{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}]
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=2,
        num_generations=2,
        max_steps=1,
        max_completion_length=8,
        gradient_checkpointing=False,
    )
    from peergrade.training.harness import pool_of

    async_fn, _ = _by_name("async_chat")  # an async def harness stays on the trainer's loop
    assert pool_of(f"{AGENTS}:async_chat", 2, async_fn) is None
    assert pool_of(f"{AGENTS}:chat", 0, _by_name("chat")[0]) is None
    with pytest.raises(InputError, match="local_agent") as e:
        GRPOTrainer("bundled:tiny-calc", None, args, rows, harness=local_agent, harness_processes=2)
    assert "harness.processes" in str(e.value)


def test_grpo_trainer_with_harness_processes_trains_the_same_step(tmp_path):
    """``GRPOTrainer(harness=fn, harness_processes=2)``: the step's samples and rewards are
    those of the same run on threads; the workers are gone when train() returns."""
    import harness_agents
    from peergrade import GRPOTrainer
    from peergrade.api import GRPOConfig

    rows = [
        {
            "prompt": [{"role": "user", "content": f"{a}+{b}="}],
            "q": f"{a}+{b}=",
            "answer": str(a + b),
        }
        for a, b in [(12, 7), (23, 41)]
    ]
    samples = {}
    for processes in (0, 2):
        args = GRPOConfig(
            output_dir=str(tmp_path / f"run{processes}"),
            per_device_train_batch_size=4,
            num_generations=2,
            max_steps=1,
            max_completion_length=16,
            gradient_checkpointing=False,
        )
        trainer = GRPOTrainer(
            "bundled:tiny-calc",
            None,
            args,
            rows,
            harness=harness_agents.chat,
            harness_processes=processes,
        )
        trainer.train()
        pool = trainer._run.harness_pool
        assert (pool is None) == (processes == 0)
        if pool is not None:
            assert pool.workers == []  # closed at the end of train()
        lines = (tmp_path / f"run{processes}" / "samples.jsonl").read_text().splitlines()
        samples[processes] = [
            (s["completions"], s["rewards"], s["advantages"]) for s in map(json.loads, lines)
        ]
    assert samples[0] == samples[2] and samples[0]
    assert len({r for _, rs, _ in samples[0] for r in rs}) > 1  # rewards from the samples


def token_loop(turns: int, follow_up: str = "go on", tamper: bool = False):
    """A harness that renders its own prompts and talks tokens (vLLM's ``/inference/v1/
    generate``, as verifiers' TrainClient does): each next prompt is the last one + the reply's
    tokens + its own rendering of a user turn. ``tamper``: the 2nd prompt drops the first reply's
    first token (it no longer extends what was recorded)."""
    import httpx

    def harness(row, base_url, model):
        tok = harness.tok
        msgs = [{"role": "user", "content": row["q"]}]
        ids = render(tok, msgs, add_generation_prompt=True)
        for k in range(turns):
            body = {
                "model": model,
                "token_ids": ids,
                "sampling_params": {"max_tokens": 7, "temperature": 0.2, "logprobs": 1},
            }
            r = httpx.post(base_url + "/inference/v1/generate", json=body, timeout=60)
            assert r.status_code == 200, r.text
            out = r.json()["choices"][0]
            harness.replies.append(
                (out["token_ids"], [x["logprob"] for x in out["logprobs"]["content"]])
            )
            msgs.append(
                {
                    "role": "assistant",
                    "content": tok.decode(out["token_ids"], skip_special_tokens=True),
                }
            )
            delta = turn_delta(
                tok,
                msgs,
                [{"role": "user", "content": follow_up}],
                eos_ids=[tok.eos_token_id],
                close_turn=out["token_ids"][-1:] != [tok.eos_token_id],
            )
            msgs.append({"role": "user", "content": follow_up})
            cut = 1 if tamper and k == 0 else 0
            ids = ids + out["token_ids"][cut:] + delta
        return 1.0

    harness.replies = []
    return harness


def test_token_requests_are_recorded_token_exact(inner, merge_tok):
    """An episode driven by token requests records the client's tokens as they are: its own
    prompt tokens (mask 0) and the sampled ones (mask 1, the log-probs it was sent), the
    log-probs equal to one full forward; and the same conversation through chat requests
    records the same tokens."""
    model = Steered(inner, merge_tok.eos_token_id, eos_every=5, eos_bias=6.0)
    runs, runs_replies = {}, {}
    for name, fn in [("tokens", token_loop(3)), ("chat", chat_loop(3))]:
        fn.tok, runs_replies[name] = merge_tok, getattr(fn, "replies", None)
        runner = HarnessRunner(model, merge_tok)
        try:
            runs[name] = runner.run(
                fn,
                [{"q": "hi"}],
                n=2,
                max_completion_length=120,
                temperature=1.0,
                seed=5,
                max_tokens_per_turn=12,
            )
        finally:
            runner.close()
    tokens, chat = runs["tokens"], runs["chat"]
    assert [r.error for r in tokens] == [None, None] and [r.splits for r in tokens] == [0, 0]
    eps = [r.episode for r in tokens]
    assert [e.input_ids for e in eps] == [r.episode.input_ids for r in chat]
    assert [e.loss_mask for e in eps] == [r.episode.loss_mask for r in chat]
    assert all(e.num_turns == 3 and 0 in e.loss_mask for e in eps)
    logp, b = full_forward_logprobs(model.eval(), eps, merge_tok.pad_token_id, 1.0)
    torch.testing.assert_close(logp * b["loss_mask"], b["logprobs"], atol=1e-5, rtol=0)
    replies = runs_replies["tokens"]  # what the route answered: the recorded log-probs
    sent = sorted(round(sum(lps), 4) for _, lps in replies)
    kept = []
    for e in eps:
        lps = []
        for m, lp in zip([*e.loss_mask, 0], [*e.logprobs, 0.0]):
            if m:
                lps.append(lp)
            elif lps:
                kept.append(round(sum(lps), 4))
                lps = []
    assert sorted(kept) == sent
    # its messages are the decoded text (the roles of the client's own tokens are unknown)
    assert eps[0].messages[0]["role"] == "user" and "hi" in eps[0].messages[0]["content"]
    assert [m["role"] for m in eps[0].messages[1:4]] == ["assistant", "user", "assistant"]


def test_token_requests_that_change_the_tokens_split_and_bad_ones_fail(inner, merge_tok):
    model = Steered(inner, merge_tok.eos_token_id, eos_every=4, eos_bias=8.0)
    fn = token_loop(2, tamper=True)
    fn.tok = merge_tok

    def bad(row, base_url, model_name):
        import httpx

        r = httpx.post(
            base_url + "/inference/v1/generate",
            json={"model": model_name, "token_ids": [10**9]},
            timeout=60,
        )
        raise RuntimeError(f"{r.status_code} {r.json()['error']['param']}")

    runner = HarnessRunner(model, merge_tok)
    try:
        (split,) = runner.run(
            fn, [{"q": "q"}], n=1, max_completion_length=80, temperature=1.0, max_tokens_per_turn=8
        )
        (refused,) = runner.run(bad, [{"q": "q"}], n=1, max_completion_length=80)
    finally:
        runner.close()
    assert split.error is None and split.splits == 1 and split.requests == 2
    assert split.episode.loss_mask[: len(fn.replies[1][0])] == [1] * len(fn.replies[1][0])
    assert "400 token_ids" in refused.error


def text_loop(start: str, turns: int, follow_up: str, seen: list, *, stop_back: str = ""):
    """A completions harness (a ReAct-style loop over the openai client): the first prompt is
    ``start``, each next one the last one + the reply's text (+ ``stop_back``: what it puts
    back where a stop string cut the reply) + ``follow_up``."""

    def harness(row, base_url, model):
        c, text = client(base_url), start
        for _ in range(turns):
            r = c.completions.create(model=model, prompt=text, max_tokens=12)
            seen.append(r.choices[0].text)
            text += r.choices[0].text + stop_back + follow_up
        return 1.0

    return harness


def test_text_completions_are_recorded_token_exact(inner, merge_tok):
    """An episode of /completions requests: the client sends its growing text; the record is
    the prompt encoded, the sampled tokens as sampled ("a", "b", not the "ab" that encoding
    the text gives), and only the text the client added encoded (loss mask 0)."""
    tok, eos = merge_tok, merge_tok.eos_token_id
    chars = lambda text: [tok.encode(c, add_special_tokens=False)[0] for c in text]  # noqa: E731
    prompt, more = "Q: say it\nA:", "\nQ: again\nA:"
    turn1, turn2 = chars(" xab") + [eos], chars(" ab") + [eos]
    seq = chars(prompt) + turn1 + chars(more) + turn2
    first, second = len(prompt), len(seq) - len(turn2)
    model = forced_model(
        inner, tok, seq, [*range(first, first + len(turn1)), *range(second, len(seq))]
    )
    seen: list[str] = []
    runner = HarnessRunner(model, tok)
    r = one_episode(runner, text_loop(prompt, 2, more, seen), max_completion_length=200)
    e, ab = r.episode, tok.convert_tokens_to_ids("ab")
    assert r.error is None and r.splits == 0 and r.requests == 2 and seen == [" xab", " ab"]
    assert e.prompt_ids == chars(prompt) and e.input_ids == seq
    assert e.loss_mask == [1] * len(turn1) + [0] * len(chars(more)) + [1] * len(turn2)
    assert ab not in e.completion_ids  # the client's text, encoded, holds it twice:
    text = prompt + seen[0] + more + seen[1]
    assert tok.encode(text, add_special_tokens=False).count(ab) == 2
    logp, b = full_forward_logprobs(model.eval(), [e], tok.pad_token_id, 1.0)
    torch.testing.assert_close(logp * b["loss_mask"], b["logprobs"], atol=1e-5, rtol=0)
    assert [m["role"] for m in e.messages] == ["user", "assistant", "user", "assistant"]
    assert e.messages[2]["content"] == more and e.num_turns == 2


def test_a_text_completion_cut_at_a_stop_string_goes_on_only_with_its_tokens_text(inner, merge_tok):
    """The trainer's stop string "a" ends the turn inside the sampled token "ab": the reply's
    text leaves it out ("go "). A client that puts back "ab" extends the record; one that puts
    back only "a" sends text the recorded tokens do not stand for: a split, counted."""
    tok = merge_tok
    chars = lambda text: [tok.encode(c, add_special_tokens=False)[0] for c in text]  # noqa: E731
    turn = chars(" go ") + [tok.convert_tokens_to_ids("ab")]
    seq = chars("Q:") + turn + chars("!") + turn
    sampled = [*range(2, 2 + len(turn)), *range(len(seq) - len(turn), len(seq))]
    model = forced_model(inner, tok, seq, sampled)
    got = {}
    for back in ("ab", "a"):
        seen: list[str] = []
        runner = HarnessRunner(model, tok)
        got[back] = one_episode(
            runner, text_loop("Q:", 2, "!", seen, stop_back=back), stop=["a"], temperature=0.0
        )
        assert seen[0] == " go "
    kept, split = got["ab"], got["a"]
    assert kept.error is None and kept.splits == 0 and kept.episode.input_ids == seq
    assert split.error is None and split.splits == 1 and split.requests == 2
    assert split.episode.prompt_ids == tok.encode("Q: go a!", add_special_tokens=False)


def test_text_completion_requests_an_episode_refuses(inner, merge_tok):
    """n > 1 and a batch of prompts are a 400 naming the field; a prompt of token ids goes on
    as a token request."""
    import httpx

    model = Steered(inner, merge_tok.eos_token_id, eos_every=3, eos_bias=8.0)
    codes = {}

    def harness(row, base_url, model_name):
        def post(**b):
            body = {"model": model_name, **b}
            return httpx.post(base_url + "/completions", json=body, timeout=60)

        for name, body in [("n", {"prompt": "q", "n": 2}), ("batch", {"prompt": ["q", "r"]})]:
            r = post(**body)
            codes[name] = (r.status_code, r.json()["error"]["param"])
        r = post(
            prompt=merge_tok.encode("q", add_special_tokens=False),
            max_tokens=5,
            return_token_ids=True,
        )
        codes["ids"] = (r.status_code, r.json()["choices"][0]["token_ids"])
        return 1.0

    r = one_episode(HarnessRunner(model, merge_tok), harness)
    assert codes["n"] == (400, "n") and codes["batch"] == (400, "prompt")
    assert codes["ids"][0] == 200 and r.requests == 1 and r.episode.num_turns == 1
    assert r.episode.completion_ids == codes["ids"][1]


KILLER = """
import os
from openai import OpenAI


def agent(row, base_url, model):
    c = OpenAI(base_url=base_url, api_key="-", max_retries=0)
    c.chat.completions.create(model=model, messages=row["prompt"], max_tokens=4)
    os._exit(7)  # the agent takes its whole process down
"""


def test_a_cli_harness_that_kills_its_process_fails_its_episodes_not_the_run(tmp_path):
    """By default (harness.processes: auto) a harness given by name runs in worker
    processes, said at start-up: one that calls os._exit fails its episodes (scored 0, the
    worker's exit code in samples.jsonl) and the run goes on to the end (on threads it would
    take the trainer down with its exit code, without a word)."""
    from cli_helper import ROOT, cli

    (tmp_path / "killer.py").write_text(KILLER)
    tiny = [
        "--steps",
        "1",
        "--rollout.prompts_per_step",
        "2",
        "--rollout.group_size",
        "2",
        "--train.eval_size",
        "2",
        "--train.eval_samples",
        "1",
        "--train.threads",
        "1",
        "--train.save_every",
        "0",
        "--train.on_reward_error",
        "zero",
    ]
    out = cli(
        [
            "train",
            "--config",
            str(ROOT / "configs" / "calculator.yaml"),
            "--env.factory",
            "null",
            "--harness",
            "killer.py:agent",
            *tiny,
            "-o",
            "run",
        ],
        tmp_path,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    n = min(4, os.cpu_count() or 1)
    workers = f"{n} worker process{'es' if n > 1 else ''}"
    assert f"killer.py:agent runs in {workers} (harness.processes: auto" in out.stdout
    (m,) = [
        json.loads(x)
        for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if "loss/policy" in x
    ]
    assert m["harness/failed"] == 1.0 and m["harness/failed_exception"] == 1.0
    sample = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])
    assert "died with exit code 7" in sample["extra"]["harness_error"][0]


def test_a_token_request_without_max_tokens_gets_the_trainer_s_turn_budget(inner, merge_tok):
    """vLLM's default of 16 tokens is for a plain request; in a training episode a request
    that names no max_tokens samples up to the trainer's per-turn budget, as a chat one does."""
    import httpx

    model = Steered(inner, merge_tok.eos_token_id, eos_every=1, eos_bias=-1e4)  # never eos

    def harness(row, base_url, model_name):
        ids = render(merge_tok, [{"role": "user", "content": "q"}], add_generation_prompt=True)
        r = httpx.post(
            base_url + "/inference/v1/generate",
            json={"model": model_name, "token_ids": ids},
            timeout=60,
        )
        return float(len(r.json()["choices"][0]["token_ids"]))

    runner = HarnessRunner(model, merge_tok)
    try:
        (r,) = runner.run(
            harness,
            [{"q": "q"}],
            n=1,
            max_completion_length=100,
            temperature=1.0,
            max_tokens_per_turn=24,
        )
    finally:
        runner.close()
    assert r.error is None and r.reward == 24.0 and sum(r.episode.loss_mask) == 24
