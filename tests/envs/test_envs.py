"""Multi-turn episodes (peergrade.envs): token in/token out, masks, exact log-probs, budgets,
tools and the start-up checks, on tiny Qwen2 models with a Qwen2-style tool template."""

from __future__ import annotations

import asyncio

import pytest
import torch

from peergrade.envs import (
    Step,
    TemplateError,
    ToolEnvironment,
    parse_tool_calls,
    tool_environment_factory,
)
from peergrade.envs.protocol import maybe_await
from peergrade.envs.template import render, turn_delta
from peergrade.errors import InputError
from peergrade.generation import Samples
from peergrade.generation.episodes import run_episodes
from peergrade.model.load import position_ids_from_mask
from peergrade.model.tiny import TOOL_CHAT_TEMPLATE, build_char_tokenizer, build_tiny_model

MARK = "FEEDBACK#"  # environment text that the model's own tokens must never contain


class Steered(torch.nn.Module):
    """A causal LM whose logits are nudged by the position of the input token: ``forced``
    (position -> token) adds a huge logit to that token; ``eos_every``/``eos_bias`` raise eos at
    every k-th position, so a random tiny model ends turns (and episodes have several)."""

    def __init__(self, inner, eos_id, *, forced=None, eos_every=0, eos_bias=0.0):
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.generation_config = inner.generation_config
        self.eos_id, self.forced = eos_id, forced or {}
        self.eos_every, self.eos_bias = eos_every, eos_bias
        self.widths = []  # tokens per forward pass

    def forward(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        cache=None,
        use_cache=None,
        logits_to_keep=0,
    ):
        self.widths.append(input_ids.shape[1])
        out = self.inner(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
        )
        logits = out.logits
        pos = position_ids[:, -logits.shape[1] :]  # [B, Q]
        if self.eos_every:
            hit = ((pos + 1) % self.eos_every == 0).to(logits.dtype)
            logits[..., self.eos_id] += self.eos_bias * hit
        for p, tok in self.forced.items():
            logits[..., tok] += 1e4 * (pos == p).to(logits.dtype)
        return out


class Feedback:
    """A native environment: answers each turn with a user message until ``rounds`` turns."""

    def __init__(self, rounds=3, role="user"):
        self.rounds, self.role, self.turns = rounds, role, 0

    def reset(self, row):
        return [{"role": "user", "content": row["q"]}]

    async def step(self, message):  # async on purpose: the runner awaits it
        self.turns += 1
        if self.turns >= self.rounds:
            return Step(done=True, reward=1.0)
        return Step([{"role": self.role, "content": f"{MARK}{self.turns} more"}], reward=0.5)


ROWS = [{"q": "hi"}, {"q": "tell me a longer story"}, {"q": "x"}]


@pytest.fixture(scope="module")
def tool_tok():
    return build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def base_model(tool_tok):
    model, _ = build_tiny_model("qwen2", tool_tok, seed=0, max_position_embeddings=2048)
    return model.eval()


def episodes_batch(episodes, pad_id):
    """The update's tensors of ``episodes``, through the one record (``Samples``)."""
    s = Samples.of_episodes(episodes, pad_id, n=1)
    input_ids, attention_mask, _ = s.training_batch(pad_id)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": s.loss_mask,
        "logprobs": s.logprobs,
        "sampler_logprobs": s.sampler_logprobs,
    }


def full_forward_logprobs(model, episodes, pad_id, temperature):
    """Log-probs of every completion token from ONE forward over the final sequences."""
    b = episodes_batch(episodes, pad_id)
    p = b["input_ids"].shape[1] - b["loss_mask"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=b["input_ids"],
            attention_mask=b["attention_mask"],
            position_ids=position_ids_from_mask(b["attention_mask"]),
        ).logits.float()
    logits = logits[:, p - 1 : -1]
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, b["input_ids"][:, p:, None]).squeeze(-1)
    return logp, b


def plain_loop(model, tok, row, env, budget, turn_cap, eos_id):
    """Reference: greedy turn by turn with full forwards (no cache), the same token deltas."""
    messages = env.reset(row)
    ids = render(tok, messages, add_generation_prompt=True)
    start = len(ids)
    while True:
        turn = []
        while True:
            with torch.no_grad():
                pos = torch.arange(len(ids))[None]
                logits = model(input_ids=torch.tensor([ids]), position_ids=pos).logits[0, -1]
            t = int(logits.argmax())
            turn.append(t)
            ids.append(t)
            if t == eos_id or len(turn) >= turn_cap or len(ids) - start >= budget:
                break
        if turn[-1] != eos_id:
            return ids
        msg = {"role": "assistant", "content": tok.decode(turn[:-1], skip_special_tokens=True)}
        st = asyncio.run(env.step(msg))
        messages.append(msg)
        if st.done:
            return ids
        delta = turn_delta(tok, messages, st.messages, eos_ids=[eos_id])
        if len(ids) - start + len(delta) > budget:
            return ids
        messages += st.messages
        ids += delta


# ---------------------------------------------------------------- episodes on a sampling model


@pytest.fixture(scope="module")
def sampled_episodes(base_model, tool_tok):
    model = Steered(base_model, tool_tok.eos_token_id, eos_every=7, eos_bias=6.0)
    eps = run_episodes(
        model,
        tool_tok,
        ROWS,
        lambda row: Feedback(rounds=3),
        n=2,
        max_completion_length=120,
        max_tokens_per_turn=40,
        temperature=1.0,
        top_k=50,
        seed=3,
    )
    return model, eps


def test_episodes_have_several_turns_and_consistent_records(sampled_episodes, tool_tok):
    _, eps = sampled_episodes
    assert len(eps) == 6 and [e.row_index for e in eps] == [0, 0, 1, 1, 2, 2]
    assert max(e.num_turns for e in eps) >= 2, [e.finish_reason for e in eps]
    for e in eps:
        assert len(e.completion_ids) == len(e.loss_mask) == len(e.logprobs) <= 120
        assert e.attention_mask == [1] * len(e.input_ids)
        assert e.finish_reason in {"done", "length", "turn_length", "env_over_budget"}
        assert e.completion_messages[0]["role"] == "assistant"
        if e.finish_reason == "done":
            assert e.num_turns == 3 and e.reward == pytest.approx(2.0)
        # every environment answer in the messages is in the tokens, and only once
        text = tool_tok.decode(e.completion_ids)
        for k in range(1, e.num_turns):
            if k < 3 and any(m["content"] == f"{MARK}{k} more" for m in e.messages):
                assert text.count(f"{MARK}{k} more") == 1


def test_sampled_logprobs_equal_one_full_forward(sampled_episodes, tool_tok):
    model, eps = sampled_episodes
    logp, b = full_forward_logprobs(model, eps, tool_tok.pad_token_id, 1.0)
    mask = b["loss_mask"]
    assert (
        mask.sum() > 0
        and (mask == 0).logical_and(b["attention_mask"][:, -mask.shape[1] :] == 1).any()
    )
    torch.testing.assert_close(logp * mask, b["logprobs"], atol=1e-5, rtol=0)


def test_masked_in_tokens_hold_no_environment_text(sampled_episodes, tool_tok):
    _, eps = sampled_episodes
    eos = tool_tok.eos_token_id
    for e in eps:
        ids, mask = e.completion_ids, e.loss_mask
        sampled = tool_tok.decode([t for t, m in zip(ids, mask) if m])
        appended = tool_tok.decode(
            [t for t, m in zip(ids, mask) if not m], skip_special_tokens=False
        )
        assert MARK not in sampled and "<|im_start|>user" not in sampled
        if e.num_turns >= 2 and e.finish_reason != "env_over_budget":
            assert MARK in appended
        # boundaries: a sampled turn ends with eos, the template's newline after it is appended
        for i in range(len(ids) - 1):
            if mask[i] == 1 and mask[i + 1] == 0:
                assert ids[i] == eos and tool_tok.decode([ids[i + 1]]) == "\n"
        # no second (default) system prompt inside the episode
        assert "You are helpful." not in appended


def test_episodes_do_not_depend_on_the_micro_batch(sampled_episodes, tool_tok):
    model, eps = sampled_episodes
    again = run_episodes(
        model,
        tool_tok,
        ROWS,
        lambda row: Feedback(rounds=3),
        n=2,
        max_completion_length=120,
        max_tokens_per_turn=40,
        temperature=1.0,
        top_k=50,
        seed=3,
        batch_size=1,
    )
    assert [e.completion_ids for e in again] == [e.completion_ids for e in eps]


def test_episodes_of_rank_shards_with_global_keys_equal_one_process(sampled_episodes, tool_tok):
    """Each half of the rows run alone with its global indices as keys (two simulated ranks)
    samples the episodes one call over all rows samples."""
    model, eps = sampled_episodes
    half = len(ROWS) // 2
    kw = dict(n=2, max_completion_length=120, max_tokens_per_turn=40, temperature=1.0, top_k=50)
    parts = [
        run_episodes(
            model,
            tool_tok,
            ROWS[lo:hi],
            lambda row: Feedback(rounds=3),
            seed=3,
            row_keys=range(lo, hi),
            **kw,
        )
        for lo, hi in ((0, half), (half, len(ROWS)))
    ]
    assert [e.completion_ids for p in parts for e in p] == [e.completion_ids for e in eps]


def test_greedy_episodes_equal_a_plain_transformers_loop(base_model, tool_tok):
    model = Steered(base_model, tool_tok.eos_token_id, eos_every=5, eos_bias=30.0)
    eos = tool_tok.eos_token_id
    eps = run_episodes(
        model,
        tool_tok,
        ROWS,
        lambda row: Feedback(rounds=3),
        max_completion_length=100,
        max_tokens_per_turn=30,
        temperature=0.0,
    )
    assert max(e.num_turns for e in eps) >= 2
    for row, e in zip(ROWS, eps):
        ref = plain_loop(model, tool_tok, row, Feedback(rounds=3), 100, 30, eos)
        assert e.input_ids == ref


# ---------------------------------------------------------------- forced turns: exact content


def forced_model(base_model, tok, seq: list[int], sampled_from: list[int]):
    """Force the model to sample ``seq[p]`` at every position p in ``sampled_from``."""
    return Steered(base_model, tok.eos_token_id, forced={p - 1: seq[p] for p in sampled_from})


def script(tok, row, env_answers, turns, tools=None):
    """The exact token sequence of an episode whose model turns are ``turns`` (text, sampled
    char by char + eos) and whose environment answers ``env_answers``; returns (ids, positions
    of sampled tokens)."""
    messages = [{"role": "user", "content": row["q"]}]
    ids = render(tok, messages, add_generation_prompt=True, tools=tools)
    sampled = []
    for k, text in enumerate(turns):
        turn = [tok.encode(c, add_special_tokens=False)[0] for c in text] + [tok.eos_token_id]
        sampled += range(len(ids), len(ids) + len(turn))
        ids = ids + turn
        if k < len(env_answers):
            messages.append({"role": "assistant", "content": text})
            delta = turn_delta(
                tok, messages, env_answers[k], eos_ids=[tok.eos_token_id], tools=tools
            )
            messages += env_answers[k]
            ids = ids + delta
    return ids, sampled


class Fixed:
    """Answers every turn with the same user message; never done."""

    def reset(self, row):
        return [{"role": "user", "content": row["q"]}]

    def step(self, message):
        return Step([{"role": "user", "content": "go on"}])


def test_sampled_tokens_are_never_retokenised(base_model):
    # "ab" is one token of this tokenizer; the model samples "a" and "b" separately. A history
    # rebuilt from text would hold the merged token and different log-probs.
    tok = build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE, merges=(("a", "b"),))
    inner, _ = build_tiny_model("qwen2", tok, seed=0, max_position_embeddings=2048)
    row = {"q": "say ab"}
    seq, pos = script(tok, row, [[{"role": "user", "content": "go on"}]], ["xab", "ab"])
    model = forced_model(inner, tok, seq, pos)
    (e,) = run_episodes(
        model,
        tok,
        [row],
        lambda r: Fixed(),
        max_completion_length=200,
        max_turns=2,
        temperature=1.0,
        seed=0,
    )
    a, b, ab = (tok.convert_tokens_to_ids(t) for t in ("a", "b", "ab"))
    assert e.input_ids == seq and e.finish_reason == "max_turns"
    assert [t for t, m in zip(e.completion_ids, e.loss_mask) if m] == [
        tok.convert_tokens_to_ids("x"),
        a,
        b,
        tok.eos_token_id,
        a,
        b,
        tok.eos_token_id,
    ]
    assert ab not in e.completion_ids
    assert tok.encode("ab", add_special_tokens=False) == [ab]  # what re-encoding would hold
    logp, bt = full_forward_logprobs(model.eval(), [e], tok.pad_token_id, 1.0)
    torch.testing.assert_close(logp * bt["loss_mask"], bt["logprobs"], atol=1e-5, rtol=0)


def test_a_turn_ends_at_a_stop_string_token_exactly(base_model):
    """A stop string ends a model turn as it ends a single reply: the token in which it
    completes is kept ("ab", though the stop string is "a"), the message text is cut after it,
    and the environment's answer follows the template's end-of-turn token, masked out."""
    tok = build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE, merges=(("a", "b"),))
    inner, _ = build_tiny_model("qwen2", tok, seed=0, max_position_embeddings=2048)
    row, eos = {"q": "q"}, tok.eos_token_id
    chars = lambda text: [tok.encode(c, add_special_tokens=False)[0] for c in text]  # noqa: E731
    prompt = render(tok, [{"role": "user", "content": "q"}], add_generation_prompt=True)
    turn1 = chars("go ") + [tok.convert_tokens_to_ids("ab")]
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "go a"}]
    go_on = [{"role": "user", "content": "go on"}]
    delta = turn_delta(tok, history, go_on, eos_ids=[eos], close_turn=True)
    assert delta[0] == eos and delta[1:] == turn_delta(tok, history, go_on, eos_ids=[eos])
    turn2 = chars("ok") + [eos]
    seq = prompt + turn1 + delta + turn2
    first = len(prompt)
    sampled = [*range(first, first + len(turn1)), *range(len(seq) - len(turn2), len(seq))]
    model = forced_model(inner, tok, seq, sampled)

    def run(stop):
        kw = dict(max_completion_length=200, max_turns=2, max_tokens_per_turn=12)
        return run_episodes(model, tok, [row], lambda r: Fixed(), temperature=0.0, stop=stop, **kw)

    (e,) = run(["a"])
    assert e.input_ids == seq and e.finish_reason == "max_turns"
    assert e.loss_mask == [1] * len(turn1) + [0] * len(delta) + [1] * len(turn2)
    assert e.completion_messages == [
        {"role": "assistant", "content": "go a"},
        {"role": "user", "content": "go on"},
        {"role": "assistant", "content": "ok"},
    ]
    logp, bt = full_forward_logprobs(model.eval(), [e], tok.pad_token_id, 0.0)
    torch.testing.assert_close(logp * bt["loss_mask"], bt["logprobs"], atol=1e-5, rtol=0)
    (e,) = run(["zz"])  # a stop string never sampled: the first turn runs past "go ab"
    assert e.completion_ids[: len(turn1)] == turn1 and e.loss_mask[len(turn1)] == 1
    assert e.completion_messages[0]["content"].startswith("go ab")
    with pytest.raises(ValueError, match="stop"):
        run([""])


@pytest.mark.parametrize("slack", [0, -1])
def test_episode_budget_keeps_an_exact_fit_and_drops_an_answer_that_overflows(
    base_model, tool_tok, slack
):
    row = {"q": "q"}
    answer = [{"role": "user", "content": "go on"}]
    seq, pos = script(tool_tok, row, [answer], ["one"])
    prompt_len = len(
        render(tool_tok, [{"role": "user", "content": "q"}], add_generation_prompt=True)
    )
    budget = len(seq) - prompt_len + slack  # turn 1 + the answer's delta (+ slack)
    model = forced_model(base_model, tool_tok, seq, pos)
    (e,) = run_episodes(
        model, tool_tok, [row], lambda r: Fixed(), max_completion_length=budget, temperature=0.0
    )
    if slack == 0:
        assert e.finish_reason == "length" and e.input_ids == seq
        assert e.messages[-1] == answer[0] and len(e.completion_ids) == budget
    else:
        assert e.finish_reason == "env_over_budget"
        assert e.input_ids == seq[: pos[-1] + 1] and e.messages[-1]["role"] == "assistant"
    assert sum(e.loss_mask) == 4 and e.num_turns == 1


def test_turn_budgets_and_max_turns(base_model, tool_tok):
    row = {"q": "q"}
    seq, pos = script(
        tool_tok, row, [[{"role": "user", "content": "go on"}]] * 3, ["one", "two", "six", "ten"]
    )
    model = forced_model(base_model, tool_tok, seq, pos)

    def run(**kw):
        return run_episodes(model, tool_tok, [row], lambda r: Fixed(), temperature=0.0, **kw)[0]

    e = run(max_completion_length=500, max_turns=2)
    assert (e.finish_reason, e.num_turns) == ("max_turns", 2)
    e = run(max_completion_length=500, max_tokens_per_turn=3)  # "one" + eos needs 4
    assert (e.finish_reason, e.num_turns, len(e.completion_ids)) == ("turn_length", 1, 3)
    assert e.completion_messages == [{"role": "assistant", "content": "one"}]
    e = run(max_completion_length=2)
    assert (e.finish_reason, e.completion_ids) == ("length", seq[pos[0] : pos[0] + 2])


# ---------------------------------------------------------------- TRL's tool contract


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


async def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term
        b: the second term
    """
    await asyncio.sleep(0)
    return a + b


def explode(x: int) -> int:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("boom")


class Counter:
    """An environment_factory class: reset, a tool method, get_reward."""

    def reset(self, **row):
        self.calls = 0
        return " (count with bump)"

    def bump(self, by: int) -> str:
        """Bump the counter.

        Args:
            by: how much
        """
        self.calls += by
        return f"count={self.calls}"

    def get_reward(self) -> float:
        return float(self.calls)


@pytest.mark.parametrize(
    "text, n_calls, n_errors",
    [
        ('<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>', 1, 0),
        (
            'x <tool_call>\n{"name": "a", "arguments": {}}\n</tool_call><tool_call>{"name": "b", "arguments": "{\\"q\\": 1}"}</tool_call>',
            2,
            0,
        ),
        ("<tool_call>{not json}</tool_call>", 0, 1),
        ('<tool_call>{"arguments": {}}</tool_call>', 0, 1),
        ('<tool_call>{"name": "m", "arguments": [1]}</tool_call>', 0, 1),
        ('<tool_call>{"name": "m", "arguments": {}}', 0, 1),
        ("just an answer", 0, 0),
    ],
)
def test_parse_tool_calls(text, n_calls, n_errors):
    content, calls, errors = parse_tool_calls(text)
    assert (len(calls), len(errors)) == (n_calls, n_errors)
    # a well-formed call leaves the content; a malformed one stays in it as the model wrote it
    assert ("<tool_call>" in content) == bool(n_errors)
    if n_errors:
        assert text.strip() in content or content in text
    for c in calls:
        assert c["type"] == "function" and isinstance(c["function"]["arguments"], dict)


def test_tool_environment_runs_every_call_and_reports_failures():
    env = ToolEnvironment([multiply, add, explode])
    asyncio.run(maybe_await(env.reset({"prompt": "hi"})))
    msg = {
        "role": "assistant",
        "content": 'ok <tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        '<tool_call>{"name": "explode", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "multiply", "arguments": {"a": 1}}</tool_call>'
        "<tool_call>{bad</tool_call>",
    }
    st = asyncio.run(env.step(msg))
    assert not st.done and (st.tool_calls, st.tool_failures) == (6, 4)
    assert [m["content"] for m in st.messages[:2]] == ["42", "3"]
    assert "boom" in st.messages[2]["content"] and "not found" in st.messages[3]["content"]
    assert "error" in st.messages[4]["content"] and "error" in st.messages[5]["content"]
    # the malformed call's text stays in the message (logs, report, rewards see it)
    assert msg["content"] == "ok <tool_call>{bad</tool_call>" and len(msg["tool_calls"]) == 5
    st = asyncio.run(env.step({"role": "assistant", "content": "42"}))
    assert st.done and st.finish_reason == "answer"


class Opaque:
    pass


def opaque(a: int):
    """Return an object the model cannot read.

    Args:
        a: ignored
    """
    return Opaque()


async def raw_bytes(a: int):
    """Return bytes.

    Args:
        a: ignored
    """
    return b"\x00\x01"


def structured(a: int) -> dict[str, list[float]]:
    """Return JSON-able data, with a Fraction (a numbers.Number, as numpy scalars are).

    Args:
        a: how many
    """
    from fractions import Fraction

    return {"values": [0.5] * a, "ratio": [Fraction(1, 3)]}


@pytest.mark.parametrize("tool", [opaque, raw_bytes])
def test_a_tool_returning_something_unserialisable_is_one_error_naming_it(tool):
    env = ToolEnvironment([tool, structured])
    asyncio.run(maybe_await(env.reset({"prompt": "hi"})))
    call = '<tool_call>{"name": "%s", "arguments": {"a": 2}}</tool_call>'
    st = asyncio.run(env.step({"role": "assistant", "content": call % "structured"}))
    assert st.tool_failures == 0 and "0.5" in st.messages[0]["content"]
    with pytest.raises(InputError) as err:
        asyncio.run(env.step({"role": "assistant", "content": call % tool.__name__}))
    msg = str(err.value)
    assert f"tool {tool.__name__} returned a" in msg and "a tool must return a str" in msg


def test_max_tool_calling_iterations():
    env = ToolEnvironment([multiply], max_tool_calling_iterations=1)
    asyncio.run(maybe_await(env.reset({"prompt": "hi"})))
    call = '<tool_call>{"name": "multiply", "arguments": {"a": 1, "b": 2}}</tool_call>'
    assert not asyncio.run(env.step({"role": "assistant", "content": call})).done
    st = asyncio.run(env.step({"role": "assistant", "content": call}))
    assert st.done and st.finish_reason == "max_tool_calls" and st.tool_calls == 0


def test_tools_run_inside_episodes(base_model, tool_tok):
    make = tool_environment_factory([multiply, explode], Counter, max_tool_calling_iterations=3)
    row = {"prompt": [{"role": "user", "content": "count"}], "extra": 1}
    env = make(row)
    opened = asyncio.run(maybe_await(env.reset(row)))
    assert opened[-1]["content"] == "count (count with bump)"
    calls = (
        '<tool_call>\n{"name": "bump", "arguments": {"by": 2}}\n</tool_call>'
        '<tool_call>\n{"name": "explode", "arguments": {"x": 0}}\n</tool_call>'
    )
    turns = [calls, "done"]
    # the script's rendering of turn 1 holds the text; the runner's holds parsed tool_calls:
    # the deltas after an eos are the same either way
    answers = [
        [
            {"role": "tool", "name": "bump", "content": "count=2"},
            {"role": "tool", "name": "explode", "content": "{'error': 'boom'}"},
        ]
    ]
    messages = [dict(m) for m in opened]
    ids = render(tool_tok, messages, add_generation_prompt=True, tools=env.tools)
    pos = []
    for k, text in enumerate(turns):
        turn = [tool_tok.encode(c, add_special_tokens=False)[0] for c in text] + [
            tool_tok.eos_token_id
        ]
        pos += range(len(ids), len(ids) + len(turn))
        ids += turn
        if k == 0:
            messages.append({"role": "assistant", "content": text})
            ids += turn_delta(
                tool_tok, messages, answers[0], eos_ids=[tool_tok.eos_token_id], tools=env.tools
            )
            messages += answers[0]
    model = forced_model(base_model, tool_tok, ids, pos)
    (e,) = run_episodes(model, tool_tok, [row], make, max_completion_length=400, temperature=0.0)
    assert e.input_ids == ids and e.finish_reason == "answer"
    assert (e.num_turns, e.tool_calls, e.tool_failures) == (2, 2, 1)
    roles = [m["role"] for m in e.completion_messages]
    assert roles == ["assistant", "tool", "tool", "assistant"]
    assert e.completion_messages[0]["tool_calls"][0]["function"] == {
        "name": "bump",
        "arguments": {"by": 2},
    }
    assert e.env.instance.get_reward() == 2.0
    sampled = tool_tok.decode([t for t, m in zip(e.completion_ids, e.loss_mask) if m])
    assert "count=2" not in sampled and "boom" not in sampled and "<tool_call>" in sampled


# ---------------------------------------------------------------- bad input, start-up checks


def no_hints(a, b):
    """Multiply.

    Args:
        a: x
        b: y
    """
    return a * b


def no_doc(a: int) -> int:
    return a


def returns_bytes(a: int) -> bytes:
    """Encode.

    Args:
        a: x
    """
    return bytes(a)


class NoReset:
    def bump(self, by: int) -> int:
        """Bump.

        Args:
            by: how much
        """
        return by


class UndocumentedTool:
    def reset(self, **row):
        return None

    def poke(self, x):
        return x


@pytest.mark.parametrize(
    "kwargs, names",
    [
        (dict(tools=[no_hints]), ["no_hints", "type hints"]),
        (dict(tools=[no_doc]), ["no_doc", "docstring"]),
        (dict(tools=[returns_bytes]), ["returns_bytes", "bytes", "not JSON", "must return"]),
        (dict(environment_factory=NoReset), ["NoReset", "reset"]),
        (dict(environment_factory=UndocumentedTool), ["UndocumentedTool", "poke"]),
        (dict(environment_factory={"a": Counter, "b": NoReset}), ["'b'", "NoReset"]),
        (dict(tools=[multiply], max_tool_calling_iterations=-1), ["max_tool_calling_iterations"]),
    ],
)
def test_bad_tools_and_environments_are_one_clear_error(kwargs, names):
    with pytest.raises(InputError) as err:
        tool_environment_factory(**kwargs)
    for name in names:
        assert name in str(err.value)


BROKEN_TEMPLATES = {
    # earlier assistant turns are rendered differently once a message follows them
    "rewrites history": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}(old){% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    # Qwen3-style: reasoning of assistant turns before the last user message is dropped
    "drops old reasoning": (
        "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
        "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}{{ '\\n' }}"
        "{% if m['role'] == 'assistant' and loop.index0 < ns.last %}"
        "{{ m['content'].split('</think>')[-1].lstrip() }}{% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
    ),
    # tool messages vanish
    "drops tool text": (
        "{% for m in messages %}{% if m['role'] != 'tool' %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    # tool messages are refused (roles must alternate, as some templates insist)
    "raises on tool": (
        "{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    # an assistant turn has no end-of-turn token
    "no eos": (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    ),
}


@pytest.mark.parametrize("name", sorted(BROKEN_TEMPLATES))
def test_templates_that_cannot_render_episodes_stop_at_start_up(base_model, name):
    tok = build_char_tokenizer(chat_template=BROKEN_TEMPLATES[name])
    tok.name_or_path = "my-broken-template"
    with pytest.raises(TemplateError) as err:
        run_episodes(base_model, tok, ROWS, lambda r: Feedback(), max_completion_length=10)
    msg = str(err.value)
    assert "my-broken-template" in msg and "chat_template" in msg


def test_a_native_environment_without_reset_is_named():
    from peergrade.envs import make_env_from_objects

    class StepOnly:
        def step(self, message):
            return Step(done=True)

    with pytest.raises(InputError) as err:
        make_env_from_objects([], StepOnly)
    assert "StepOnly" in str(err.value) and "reset(row)" in str(err.value)


def test_an_environment_without_step_is_named(base_model, tool_tok):
    class Half:
        def reset(self, row):
            return "hi"

    with pytest.raises(InputError, match="Half has no step"):
        run_episodes(base_model, tool_tok, ROWS, lambda r: Half(), max_completion_length=10)


def test_environment_classes_are_picked_per_row_and_reset_with_the_row():
    class Other:
        def reset(self, **row):
            self.row = row
            return "!"

    make = tool_environment_factory([multiply], {"count": Counter, "other": Other})
    env = make({"prompt": "p", "environment": "other", "k": 1})
    row = {"prompt": "p", "environment": "other", "k": 1}
    opened = asyncio.run(maybe_await(env.reset(row)))
    assert isinstance(env.instance, Other) and env.instance.row == {"prompt": "p", "k": 1}
    assert opened == [{"role": "user", "content": "p!"}]
    assert [t["function"]["name"] for t in env.tools] == ["multiply"]
    env = make({"prompt": "p", "environment": "count"})
    assert [t["function"]["name"] for t in env.tools] == ["multiply", "bump"]
    with pytest.raises(InputError, match="'environment' column"):
        make({"prompt": "p", "environment": "nope"})


def test_an_environment_that_raises_is_named(base_model, tool_tok):
    class Broken(Fixed):
        def step(self, message):
            raise KeyError("oops")

    model = Steered(base_model, tool_tok.eos_token_id, eos_every=3, eos_bias=1e4)
    with pytest.raises(RuntimeError, match=r"Broken.step \(rows\[0\]\) raised KeyError"):
        run_episodes(
            model, tool_tok, ROWS, lambda r: Broken(), max_completion_length=20, temperature=0.0
        )


def test_a_row_without_a_prompt_is_a_clear_error(base_model, tool_tok):
    with pytest.raises(InputError, match="'prompt' column"):
        run_episodes(
            base_model,
            tool_tok,
            [{"q": 1}],
            tool_environment_factory([multiply]),
            max_completion_length=5,
        )


def test_tool_timeouts_and_output_truncation():
    import threading

    release = threading.Event()

    def stuck(x: int) -> int:
        """Waits until released.

        Args:
            x: anything
        """
        release.wait(60)
        return x

    async def stuck_async(x: int) -> int:
        """Never finishes.

        Args:
            x: anything
        """
        await asyncio.Event().wait()
        return x

    def long(n: int) -> str:
        """A long result.

        Args:
            n: its length
        """
        return "z" * n

    make = tool_environment_factory(
        [stuck, stuck_async, long, multiply], tool_timeout=0.05, max_tool_output_chars=10
    )
    env = make({"prompt": "p"})
    calls = "".join(
        f'<tool_call>{{"name": "{n}", "arguments": {{{a}}}}}</tool_call>'
        for n, a in [
            ("stuck", '"x": 1'),
            ("stuck_async", '"x": 1'),
            ("long", '"n": 25'),
            ("multiply", '"a": 2, "b": 5'),
        ]
    )
    try:
        st = asyncio.run(env.step({"role": "assistant", "content": calls}))
    finally:
        release.set()
    assert (st.tool_calls, st.tool_failures) == (4, 2)
    assert [m["content"] for m in st.messages[:2]] == [str({"error": "timed out after 0.05s"})] * 2
    assert st.messages[2]["content"] == "z" * 10 + "... [truncated 15 characters]"
    assert st.messages[3]["content"] == "10"
    with pytest.raises(InputError, match="tool_timeout"):
        tool_environment_factory([multiply], tool_timeout=0)


def test_reward_functions_get_whole_conversations(sampled_episodes):
    from peergrade.envs import reward_inputs
    from peergrade.rewards.registry import make_reward_spec, score_rewards

    _, eps = sampled_episodes
    seen = {}

    def turns(prompts, completions, completion_ids, environments, q, **kwargs):
        seen.update(prompts=prompts, ids=completion_ids, envs=environments, q=q)
        return [float(sum(m["role"] == "assistant" for m in c)) for c in completions]

    prompts, completions, columns = reward_inputs(eps, ROWS)
    scores = score_rewards([make_reward_spec(turns)], prompts, completions, columns)
    assert scores.per_fn["turns"].tolist() == [float(e.num_turns) for e in eps]
    assert seen["q"] == [r["q"] for r in ROWS for _ in range(2)]
    assert seen["ids"] == [e.completion_ids for e in eps]
    assert seen["envs"] == [e.env for e in eps]
    assert seen["prompts"][2] == [{"role": "user", "content": ROWS[1]["q"]}]


def test_tools_and_environments_load_from_files(tmp_path):
    from peergrade.envs import make_env_from_specs

    (tmp_path / "my_tools.py").write_text(
        'def multiply(a: int, b: int) -> int:\n    """Multiply.\n\n    Args:\n        a: x\n'
        '        b: y\n    """\n    return a * b\n\n\ndef bare(a):\n    return a\n'
    )
    (tmp_path / "my_env.py").write_text(
        "class Native:\n    def reset(self, row):\n        return 'hi'\n\n"
        "    def step(self, message):\n        return [], True\n\n\n"
        "class Trl:\n    def reset(self, **row):\n        return None\n"
    )
    tools, env = str(tmp_path / "my_tools.py"), str(tmp_path / "my_env.py")
    make = make_env_from_specs([f"{tools}:multiply"], f"{env}:Trl", max_tool_calling_iterations=2)
    e = make({"prompt": "p"})
    assert isinstance(e, ToolEnvironment) and e.max_iterations == 2
    assert [t["function"]["name"] for t in e.tools] == ["multiply"]
    assert type(make_env_from_specs(env=f"{env}:Native")({"q": 1})).__name__ == "Native"
    bad = [
        (dict(tools=[f"{tools}:bare"]), "bare"),
        (dict(tools=[f"{tools}:nope"]), "nope"),
        (dict(tools=[f"{tmp_path}/missing.py:f"]), "missing.py"),
        (dict(tools=["no_colon"]), "no_colon"),
        (dict(tools=[f"{tools}:multiply"], env=f"{env}:Native"), "native environment"),
        (dict(), "--env or at least one --tools"),
    ]
    for kwargs, needle in bad:
        with pytest.raises(InputError, match=needle):
            make_env_from_specs(**kwargs)


def test_long_episodes_grow_the_cache_and_stay_exact(base_model, tool_tok):
    # The cache starts at the longest prompt + 256 positions: these episodes outgrow it.
    model = Steered(base_model, tool_tok.eos_token_id, eos_every=7, eos_bias=6.0)
    eps = run_episodes(
        model,
        tool_tok,
        ROWS[:2],
        lambda row: Feedback(rounds=100),
        max_completion_length=400,
        max_tokens_per_turn=40,
        temperature=1.0,
        seed=5,
    )
    assert max(len(e.completion_ids) for e in eps) > 300
    logp, b = full_forward_logprobs(model, eps, tool_tok.pad_token_id, 1.0)
    torch.testing.assert_close(logp * b["loss_mask"], b["logprobs"], atol=1e-5, rtol=0)


def test_a_turn_feeds_only_its_new_tokens(base_model, tool_tok):
    """No forward pass after the prompt's re-reads the history: each is at most one appended
    delta plus the sampled token before it."""
    model = Steered(base_model, tool_tok.eos_token_id, eos_every=7, eos_bias=6.0)
    eps = run_episodes(
        model,
        tool_tok,
        ROWS,
        lambda row: Feedback(rounds=4),
        n=2,
        max_completion_length=150,
        max_tokens_per_turn=40,
        temperature=1.0,
        seed=1,
    )
    deltas = []
    for e in eps:
        run = 0
        for m in e.loss_mask + [1]:
            if m == 0:
                run += 1
            elif run:
                deltas.append(run)
                run = 0
    assert deltas and max(e.num_turns for e in eps) >= 3
    widths = model.widths
    assert widths[0] == max(len(e.prompt_ids) for e in eps)  # the one prefill
    assert max(widths[1:]) <= max(deltas) + 1
    assert max(len(e.input_ids) for e in eps) > 2 * (max(deltas) + 1)


def test_episode_metrics():
    from peergrade.envs import Episode, episode_metrics

    def ep(reason, turns, calls, fails, mask):
        e = Episode(0, [1], [], 0, finish_reason=reason, num_turns=turns)
        e.tool_calls, e.tool_failures, e.tool_truncated = calls, fails, fails
        e.loss_mask, e.completion_ids = mask, [5] * len(mask)
        return e

    m = episode_metrics([ep("answer", 2, 3, 1, [1, 1, 0, 1]), ep("length", 1, 1, 1, [1, 1])])
    assert m == {
        "tools/call_frequency": 2.0,
        "tools/failure_frequency": 0.5,
        "tools/truncated_frequency": 0.5,
        "turns/mean": 1.5,
        "episode/len_mean": 3.0,
        "episode/sampled_len_mean": 2.5,
        "episode/stop_reason/answer": 0.5,
        "episode/stop_reason/length": 0.5,
    }
    assert episode_metrics([ep("done", 1, 0, 0, [1])])["tools/failure_frequency"] == 0.0


def test_an_env_file_importing_a_sibling_module_loads_from_anywhere(tmp_path, monkeypatch):
    """`from helpers import ...` in my_env.py works as `python my_env.py` would: the file's
    folder is importable, wherever peergrade runs from (it was 'pip install helpers')."""
    from peergrade.envs.load import load_object

    d = tmp_path / "proj"
    d.mkdir()
    (d / "calc_helpers_34.py").write_text("def double(x):\n    return 2 * x\n")
    (d / "my_env_34.py").write_text(
        "from calc_helpers_34 import double\n\n"
        "def twice(x: int) -> int:\n"
        '    """Double it.\n\n    Args:\n        x: a number\n    """\n'
        "    return double(x)\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path])  # restored after
    fn = load_object(str(d / "my_env_34.py") + ":twice", "--tools")
    assert fn(4) == 8
