"""One generation path: ``generation.sample`` -> ``Samples`` for replies and episodes alike.

- the stored sampler log-probs are those of the distribution actually drawn from (tempered,
  top-k, top-p, renormalised), for single replies *and* episodes, checked against one fresh
  forward over the final sequences and a per-token loop of the truncation rule;
- held-out evaluation honours every sampler setting: ``top_k 1`` and ``top_p 1e-6`` make the
  sampled pass equal the greedy one (``peergrade eval``), and held-out episodes stop on
  ``rollout.stop``.
"""

from __future__ import annotations

import math

import pytest
import torch

from peergrade import generation
from peergrade.envs import Step
from peergrade.generation import SamplerSettings, Samples
from peergrade.model.load import position_ids_from_mask
from peergrade.model.tiny import TOOL_CHAT_TEMPLATE, build_char_tokenizer, build_tiny_model
from test_envs import Steered


class Chatter:
    """A native environment: answers every turn with a user message, three turns at most."""

    def __init__(self):
        self.turns = 0

    def reset(self, row):
        return [{"role": "user", "content": row["q"]}]

    def step(self, message):
        self.turns += 1
        if self.turns >= 3:
            return Step(done=True, reward=1.0)
        return Step([{"role": "user", "content": "go on"}])


@pytest.fixture(scope="module")
def chat_model():
    """A tiny chat model that ends a turn with eos every few tokens (so episodes have turns)."""
    tok = build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)
    model, _ = build_tiny_model("qwen2", tok, seed=3, max_position_embeddings=4096)
    return Steered(model.eval(), tok.eos_token_id, eos_every=7, eos_bias=30.0).eval(), tok


def truncated_logprob(logits_row: torch.Tensor, token: int, temperature, top_k, top_p) -> float:
    """Reference, one position at a time: the log-prob of ``token`` under softmax(logits / T)
    cut to the top-k tokens, then to the smallest prefix (by probability) whose mass reaches
    top_p of what top-k kept, renormalised."""
    probs = torch.softmax(logits_row.double() / temperature, -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])[:top_k]
    mass = sum(probs[i] for i in order)
    kept, before = [], 0.0
    for i in order:
        if before < top_p * mass:
            kept.append(i)
        before += probs[i]
    assert token in kept, "the sampler drew a token outside the truncated set"
    return math.log(probs[token]) - math.log(sum(probs[i] for i in kept))


def forward_logits(model, samples: Samples, pad_id: int) -> tuple[torch.Tensor, int]:
    ids, att, _ = samples.training_batch(pad_id)
    with torch.no_grad():
        logits = model(
            input_ids=ids, attention_mask=att, position_ids=position_ids_from_mask(att)
        ).logits.float()
    p = ids.shape[1] - samples.completion_ids.shape[1]
    return logits[:, p - 1 : -1], p  # [N, C, V]: the logits each completion token was drawn from


@pytest.mark.parametrize("kind", ["replies", "episodes"])
def test_sampler_logprobs_are_the_truncated_distributions(chat_model, kind):
    model, tok = chat_model
    T, top_k, top_p = 0.9, 6, 0.8
    settings = SamplerSettings(
        n=3, max_new_tokens=400, temperature=T, top_k=top_k, top_p=top_p, max_tokens_per_turn=12
    )
    rows = [{"prompt": "ab", "q": "hello"}, {"prompt": "xyz", "q": "tell me"}]
    kwargs = {}
    if kind == "episodes":
        kwargs["make_env"] = lambda row: Chatter()
    else:
        kwargs["prompt_ids"] = [tok.encode(r["prompt"], add_special_tokens=False) for r in rows]
    s = generation.sample(model, tok, rows, settings, seed=5, **kwargs)
    assert isinstance(s, Samples) and len(s.finish_reason) == 6
    assert (s.episodes is not None) == (kind == "episodes")
    if kind == "episodes":  # environment tokens exist in the sequence and are never trained on
        assert ((s.completion_mask == 1) & (s.loss_mask == 0)).any()

    logits, _ = forward_logits(model, s, tok.pad_token_id)
    checked = 0
    for i in range(len(s.finish_reason)):
        for j in torch.nonzero(s.loss_mask[i]).flatten().tolist():
            token = int(s.completion_ids[i, j])
            want = truncated_logprob(logits[i, j], token, T, top_k, top_p)
            assert s.sampler_logprobs[i, j].item() == pytest.approx(want, abs=1e-5)
            checked += 1
    assert checked > 20
    # not vacuous: truncation changes the log-probs (the full distribution's are lower)
    on = s.loss_mask > 0
    assert (s.sampler_logprobs[on] - s.logprobs[on]).max() > 1e-3
    assert (s.sampler_logprobs[s.loss_mask == 0] == 0).all()


def test_samples_take_and_concat_round_trip_episodes(chat_model):
    model, tok = chat_model
    settings = SamplerSettings(n=2, max_new_tokens=300, max_tokens_per_turn=10)
    rows = [{"q": "hi"}, {"q": "a longer one"}]
    s = generation.sample(model, tok, rows, settings, seed=1, make_env=lambda r: Chatter())
    parts = [s.take([2, 3]), s.take([0, 1]).portable()]
    joined = Samples.concat(parts, tok.pad_token_id)
    assert joined.prompt_index.tolist() == [0, 0, 1, 1]
    assert joined.completions == s.completions[2:] + s.completions[:2]
    assert [e.env for e in joined.episodes[2:]] == [None, None]  # portable: no live environment
    for i, src in enumerate([2, 3, 0, 1]):
        n = int(s.completion_mask[src].sum())
        assert joined.completion_ids[i, :n].tolist() == s.completion_ids[src, :n].tolist()
        assert torch.equal(joined.sampler_logprobs[i, :n], s.sampler_logprobs[src, :n])


def test_sampler_settings_are_one_frozen_record():
    s = SamplerSettings(n=4, max_new_tokens=8, top_k=3, stop="##")
    assert s.stop == ("##",)
    g = s.greedy()
    assert (g.n, g.temperature, g.top_k, g.stop) == (1, 0.0, 3, ("##",))
    with pytest.raises(AttributeError):
        s.n = 2  # type: ignore[misc]


@pytest.mark.parametrize("override", [("rollout.top_k", 1), ("rollout.top_p", 1e-6)])
def test_eval_sampled_pass_equals_greedy_when_sampling_is_greedy(tiny_model_dir, override):
    """``peergrade eval --rollout.top_k 1`` (or ``--rollout.top_p 1e-6``) samples the argmax
    at every step: the sampled pass is the greedy pass, for every one of the k samples."""
    from peergrade.cli.evaluate import EvalRequest, run_eval_command

    common = dict(model=str(tiny_model_dir), request=EvalRequest(n=12, k=3))
    out = run_eval_command(**common, overrides=[override, ("rollout.temperature", 1.0)])
    assert out["pass@1_sampled"] == out["pass@1_greedy"]
    assert out["pass@3"] == out["pass@1_greedy"]
    plain = run_eval_command(
        model=str(tiny_model_dir),
        request=EvalRequest(n=12, k=3, curve=True),
        overrides=[("rollout.temperature", 1.0)],
    )
    assert plain["pass@1"] == plain["pass@1_sampled"]  # the curve's first point, same samples


def test_held_out_episodes_stop_on_rollout_stop():
    """A stop string ends a held-out episode's model turn as it ends a training one: every
    assistant message is cut right after its first stop string."""
    from collections import Counter

    from peergrade.evaluation import AnswerSource, EvalOptions, evaluate
    from peergrade.rewards import RewardSpec

    tok = build_char_tokenizer(chat_template=TOOL_CHAT_TEMPLATE)
    model, _ = build_tiny_model("qwen2", tok, seed=3, max_position_embeddings=4096)
    rows = [{"prompt": [{"role": "user", "content": q}], "q": q} for q in ("hi", "what", "ok")]
    acc = RewardSpec(name="any", fn=lambda completions, **kw: [0.0] * len(completions), weight=1.0)

    def said(stop: tuple) -> list[str]:
        settings = SamplerSettings(
            n=1, max_new_tokens=300, temperature=1.0, stop=stop, max_tokens_per_turn=30
        )
        out = evaluate(
            model.eval(),
            tok,
            rows,
            [],
            acc,
            EvalOptions(k=4, settings=settings, seed=0, keep_completions=True),
            AnswerSource(make_env=lambda row: Chatter()),
        )
        return [
            m["content"]
            for c in out["completions"]
            for msgs in [c["greedy"], *c["sampled"]]
            for m in msgs
            if m["role"] == "assistant"
        ]

    free = said(())
    stop = Counter(ch for text in free for ch in text if ch.strip()).most_common(1)[0][0]
    # without the stop string, turns run past it (so the check below is not vacuous)
    assert any(text.count(stop) > 1 or not text.endswith(stop) for text in free if stop in text)
    cut = said((stop,))
    with_stop = [text for text in cut if stop in text]
    assert with_stop
    for text in with_stop:
        assert text.endswith(stop) and text.count(stop) == 1, (stop, text)
