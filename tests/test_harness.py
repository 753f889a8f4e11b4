"""Episodes recorded from an external agent through the endpoint (``generation.recorder`` and
``generation.harness``): token-exact records, the in-process engine's record, failures."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from peergrade.envs.template import render, turn_delta  # noqa: E402
from peergrade.generation.episodes import run_episodes  # noqa: E402
from peergrade.generation.harness import HarnessRunner, harness_metrics  # noqa: E402
from peergrade.model.tiny import TOOL_CHAT_TEMPLATE, build_char_tokenizer, build_tiny_model  # noqa: E402
from test_envs import Fixed, Steered, forced_model, full_forward_logprobs  # noqa: E402


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
            res = runner.run(chat_loop(3), [{"q": "hi"}, {"q": "tell me more"}], n=2,
                             max_completion_length=120, temperature=1.0, seed=5,
                             max_tokens_per_turn=12)  # fmt: skip
        finally:
            runner.close()
        out[keep] = ([r.episode.input_ids for r in res], sum(model.widths))
    assert out[True][0] == out[False][0]
    assert out[True][1] < out[False][1] * 0.7  # tokens fed through the model


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

    rows = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
            for a, b in [(12, 7), (23, 41)]]  # fmt: skip
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, num_generations=2,
        max_steps=1, max_completion_length=16, gradient_checkpointing=False,
    )  # fmt: skip
    trainer = GRPOTrainer("bundled:tiny-calc", None, args, rows, harness=harness)
    assert [s.name for s in trainer._run.rewards] == ["harness"]
    trainer.train()
    assert len(calls) >= 4  # every (prompt, sample) of the step (and the held-out passes)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    m = next(json.loads(x) for x in lines if "loss/policy" in x)
    assert m["harness/failed"] == 0.0 and "harness/answer_len" in m
